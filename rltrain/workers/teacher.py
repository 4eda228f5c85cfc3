"""The teacher role of on-policy distillation: a frozen model that scores the student's sampled tokens, built and
served as the reference is (an ActorRole of role "ref": Megatron forward-only, fused head, response rows only;
built by workers/hybrid.py's build_teacher from what this module reads).

What `teacher.*` names (`teacher_source`): an HF model directory or id (`teacher.path`), a built-in preset
(`teacher.builtin`, random init), or an rltrain checkpoint (`teacher.path=<run>/checkpoints/step_N`: the model its
run's config.json describes, its Megatron shards loaded as written, so the teacher's TP/PP must be the run's).
`check_teacher` runs on the driver before any worker starts: the teacher's files, and its vocabulary against the
student's (the teacher reads the student's token ids: one vocabulary, or a refusal naming the keys). Placement
(colocated in the training workers, or a group of its own) is workers/placement.py's. No Ray here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from rltrain.config.schema import ActorConfig, ModelConfig, TeacherConfig
from rltrain.utils.errors import UserError


class TeacherError(UserError, ValueError):
    """teacher.* names a model that cannot be the student's teacher (missing, another vocabulary, a checkpoint of
    another parallel layout)."""


@dataclass(frozen=True)
class TeacherSource:
    """Where the teacher's weights come from: `model` builds its HF config (and, without a checkpoint, its weights);
    `checkpoint`: an rltrain checkpoint whose actor shards are loaded, written at (tp, pp) over `world` ranks."""

    model: ModelConfig
    tokenizer: str
    checkpoint: str | None = None
    ckpt_tp: int = 1
    ckpt_pp: int = 1
    ckpt_world: int = 1


def teacher_source(teacher: TeacherConfig, student: ModelConfig) -> TeacherSource:
    """What teacher.* names (see the module docstring); TeacherError when a checkpoint's run cannot be read."""
    from rltrain.utils.checkpoint import MANIFEST, verify_checkpoint

    if teacher.builtin is not None:
        model = ModelConfig(builtin=teacher.builtin, overrides=dict(teacher.overrides), dtype=teacher.dtype)
        return TeacherSource(model, teacher.tokenizer or student.tokenizer or student.path or "")
    path = teacher.path
    if not os.path.isfile(os.path.join(path, MANIFEST)):  # an HF directory or hub id
        model = ModelConfig(path=path, overrides=dict(teacher.overrides), dtype=teacher.dtype,
                            trust_remote_code=teacher.trust_remote_code)
        return TeacherSource(model, teacher.tokenizer or path)
    from rltrain.config.convert import saved_run_config
    from rltrain.utils.rundir import checkpoint_run_config

    reason = verify_checkpoint(path)
    if reason is not None:
        raise TeacherError(f"teacher.path={path!r} is not a usable rltrain checkpoint: {reason}")
    run = checkpoint_run_config(path)
    if run is None:
        raise TeacherError(f"teacher.path={path!r}: an rltrain checkpoint is read with its run's config.json "
                           "(<run>/checkpoints/step_N/../../config.json), which is not there; export the checkpoint "
                           "with python -m rltrain.export and give that directory as teacher.path")
    saved = saved_run_config(run)
    model = dataclasses.replace(saved.model, dtype=teacher.dtype)
    return TeacherSource(model, teacher.tokenizer or model.tokenizer or model.path or "", checkpoint=path,
                         ckpt_tp=saved.actor.tensor_parallel_size, ckpt_pp=saved.actor.pipeline_parallel_size,
                         ckpt_world=saved.trainer.n_gpus_per_node * saved.trainer.nnodes)


def teacher_parallel(teacher: TeacherConfig, actor: ActorConfig) -> tuple[int, int, int]:
    """The teacher's (tensor, pipeline, expert) parallel sizes: colocated, the actor's (megatron keeps one mesh per
    process); in a group of its own, teacher.* (null: the actor's) and no expert parallelism."""
    tp = teacher.tensor_parallel_size or actor.tensor_parallel_size
    pp = teacher.pipeline_parallel_size or actor.pipeline_parallel_size
    return tp, pp, actor.expert_parallel_size if teacher.colocate else 1


def check_teacher(teacher: TeacherConfig, *, student: ModelConfig, student_tokenizer, actor: ActorConfig) -> None:
    """On the driver, before any worker: TeacherError unless the teacher loads and reads the student's vocabulary
    (the same token -> id table, and at least as many embedding rows as the student's model has)."""
    from rltrain.data.tokenizer import load_tokenizer
    from rltrain.models.checkpoint_files import check_model_dir
    from rltrain.models.presets import model_hf_config

    where = f"teacher.path={teacher.path!r}" if teacher.path is not None else f"teacher.builtin={teacher.builtin!r}"
    if teacher.path is not None and os.path.sep in teacher.path and not os.path.exists(teacher.path):
        raise TeacherError(f"{where} does not exist; give the teacher's HF directory (e.g. a run's export: "
                           "python -m rltrain.export) or an rltrain checkpoint directory (<run>/checkpoints/step_N)")
    src = teacher_source(teacher, student)
    if src.checkpoint is None and src.model.path:
        check_model_dir(src.model.path)
    if src.checkpoint is not None and (src.ckpt_tp, src.ckpt_pp) != teacher_parallel(teacher, actor)[:2]:
        tp, pp = teacher_parallel(teacher, actor)[:2]
        raise TeacherError(f"{where} was written at tensor/pipeline parallel {src.ckpt_tp}/{src.ckpt_pp}, and its "
                           f"shards load as written; the teacher would run at {tp}/{pp}: set teacher."
                           "tensor_parallel_size / pipeline_parallel_size to the checkpoint's (with teacher.colocate="
                           "false when they differ from the actor's), or export it with python -m rltrain.export")
    tok = load_tokenizer(src.tokenizer)
    mine, theirs = vocabulary(student_tokenizer), vocabulary(tok)
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        raise TeacherError(
            f"{where}: the teacher's tokenizer ({src.tokenizer}, {len(theirs)} tokens) is not the student's "
            f"({student.tokenizer or student.path}, {len(mine)} tokens; {len(differ)} (token, id) pairs differ, e.g. "
            f"{differ[:3]}). The teacher scores the student's token ids, so both need one vocabulary: give a teacher "
            "of the student's tokenizer (teacher.tokenizer, when the teacher's directory has none of its own)")
    need = model_hf_config(student, student_tokenizer).vocab_size
    have = model_hf_config(src.model, tok).vocab_size
    if have < need:
        raise TeacherError(f"{where}: the teacher's model has {have} vocabulary rows, the student's {need}: the student "
                           "may sample ids the teacher has no row for; give a teacher with at least the student's rows")


def vocabulary(tokenizer) -> dict[str, int]:
    """token -> id of a tokenizer (transformers' `get_vocab`, the CharTokenizer's own table)."""
    return dict(tokenizer.get_vocab())


def load_checkpoint_shard(engine, src: TeacherSource) -> None:
    """Load the actor shard of the checkpoint rank with this rank's (tp, pp) coordinates (data-parallel rank 0;
    megatron orders ranks tp fastest, then dp, then pp) into the teacher's engine: weights only."""
    from rltrain.models.megatron.compat import parallel_coordinates
    from rltrain.utils.plain import load_plain

    c = parallel_coordinates()
    dp = src.ckpt_world // (src.ckpt_tp * src.ckpt_pp)
    rank = c["tp"] + src.ckpt_tp * dp * c["pp"]
    state = load_plain(os.path.join(src.checkpoint, f"worker_rank{rank}.pt"))  # data only: nothing in the file runs
    engine.load_state_dict({"model": state["actor"]["model"]})
