"""Hydra entry point (thin): compose + validate the config, then hand it to the PPO/GRPO trainer.

Run: `python -m rltrain.main --config-name grpo_tiny` (CPU, no downloads) or `--config-name grpo_qwen3`;
any key can be overridden on the command line, e.g. `actor.lr=1e-6 trainer.fused_linear_logprob_backend=triton`.
A user's mistake (bad key, missing file, unsupported model, no sandbox isolation) ends as one message and exit 2.

Before Hydra writes into the run directory (config/entry.py), it is checked: another local user's, a shared writable
one, a link in place of a file written there or a read-only one ends as one line and exit 2 (utils/rundir.py).
Before the trainer is built (`prepare_run`): the run directory is locked for the run's life (a second run on it
exits 2 naming the first's pid), the checkpoint directory is checked, locked by its real path and cleared of crashed
runs' temp dirs, a `trainer.resume=PATH` checkpoint is checked, `trainer.resume=auto` given on the command line without
hydra.run.dir continues the newest unfinished run of the same experiment, in its own directory (config/entry.py pinned
it) or with trainer.resume_in_place=false in the fresh one (the default `auto` of a fresh run starts from step 1), and
a local `model.path` is checked for complete weights.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from omegaconf import DictConfig

from rltrain.config import config_main, register_configs, validate_config
from rltrain.config.convert import as_config, as_dict
from rltrain.config.schema import RLConfig
from rltrain.config.entry import CONFIG_DIR
from rltrain.utils.errors import find_user_error
from rltrain.utils.rundir import discard_unstarted, lock_run_dir, mark_finished, prepare_run_dir, resume_command
from rltrain.utils.stacks import enable_stack_dumps

register_configs()


def run_entry(cfg: DictConfig, validate: Callable[[Any], None], run: Callable[[Any], object],
              schema: type = RLConfig) -> None:
    """Convert the composed `cfg` to the typed `schema` (the one conversion: typed objects from here on), validate
    and run it, for an entry point (this one and rltrain.sft). A user's mistake (a UserError, raised here or in a
    Ray worker) is printed as `rltrain: <message>` and exits with code 2, never as a traceback; anything else
    propagates. `kill -USR1 <pid>` prints the process's stacks (utils/stacks.py)."""
    enable_stack_dumps()
    try:
        cfg = as_config(cfg, schema)
        validate(cfg)
        # the command line's run (Hydra's run directory; in-process callers, e.g. tests, lock nothing); under
        # torchrun (SFT) rank 0 holds the lock
        run_dir = _hydra_run_dir() if os.environ.get("RANK", "0") == "0" else None
        if run_dir is not None:
            prepare_run_dir(run_dir, _hydra_job_name())  # entry's check before Hydra wrote, again for this process
            lock_run_dir(run_dir)
        try:
            run(cfg)
        except SystemExit as stop:
            if stop.code == 4:  # a worker died (trainer/ppo.py said which, and the last good checkpoint)
                from rltrain.trainer.setup import run_directory

                print(f"rltrain: to continue in this run directory, run exactly: "
                      f"{resume_command(run_dir or run_directory())}", file=sys.stderr, flush=True)
            raise
        if run_dir is not None:
            mark_finished(run_dir)
    except Exception as err:
        user_error = find_user_error(err)
        if user_error is None:
            raise
        print(f"rltrain: {user_error}", file=sys.stderr, flush=True)
        fresh = _hydra_run_dir() if _hydra_chose_run_dir() and os.environ.get("RANK", "0") == "0" else None
        if fresh is not None:  # the recipe's new directory (not one the user named), unused: it goes again
            discard_unstarted(fresh, _hydra_job_name())
        sys.exit(2)


def prepare_run(cfg: RLConfig, run_dir: str) -> None:
    """The checks of the run's files before the trainer is built (see the module docstring); may set
    cfg.trainer.resume to the checkpoint of the run that `auto` continues."""
    from rltrain.utils.checkpoint import check_resume_checkpoint, list_checkpoints
    from rltrain.utils.rundir import claim_checkpoint_dir, find_previous_run

    t = cfg.trainer
    ckpt_dir = t.ckpt_dir or os.path.join(run_dir, "checkpoints")
    claim_checkpoint_dir(ckpt_dir, run_dir, save=t.save_freq > 0)  # writable, this user's only, locked, cleaned
    if cfg.model.builtin is None and cfg.model.path:
        from rltrain.models.checkpoint_files import check_model_dir

        check_model_dir(cfg.model.path)
    if t.resume not in ("auto", "never"):
        step = check_resume_checkpoint(t.resume)
        _check_same_model(cfg, t.resume, f"trainer.resume={t.resume!r} (step {step})")
    elif t.resume == "auto":
        own = list_checkpoints(ckpt_dir)  # the trainer picks the newest intact one (checksums read once, there)
        if own:
            if not t.ckpt_dir:
                _check_same_model(cfg, own[-1][1], f"trainer.resume=auto would continue {own[-1][1]}, which")
        elif _on_command_line("trainer.resume"):  # asked for by the user: say what it finds
            found = find_previous_run(run_dir, as_dict(cfg)) \
                if not t.ckpt_dir and not t.resume_in_place and _hydra_chose_run_dir() else None
            if found is not None:
                prev, step, path = found
                t.resume = path
                print(f"rltrain: trainer.resume=auto: continuing the run in {prev} from its checkpoint of step "
                      f"{step} ({path}); this run writes to {run_dir}", file=sys.stderr, flush=True)
            else:
                where = ckpt_dir if t.ckpt_dir or not _hydra_chose_run_dir() else \
                    f"{ckpt_dir} nor in an unfinished earlier run under {os.path.dirname(os.path.abspath(run_dir))}"
                print(f"rltrain: warning: trainer.resume=auto found no intact checkpoint in {where}; training starts "
                      "at step 1 (to continue a stopped run, rerun with its directory: hydra.run.dir=<its run "
                      "directory> trainer.resume=auto)", file=sys.stderr, flush=True)


def _check_same_model(cfg, ckpt: str, what: str) -> None:
    """CheckpointError when the run that wrote checkpoint `ckpt` (its config.json) had another model."""
    from rltrain.utils.checkpoint import CheckpointError
    from rltrain.utils.rundir import checkpoint_run_config, model_differences

    saved = checkpoint_run_config(ckpt)
    diff = model_differences(saved, as_dict(cfg)) if saved is not None else []
    if diff:
        raise CheckpointError(f"{what} was saved by a run of another model ({', '.join(diff)}); resume with the "
                              "model settings it was saved with, or start fresh (trainer.resume=never, or another "
                              "run directory)")




def _on_command_line(key: str) -> bool:
    """Whether `key=...` was given on the command line (not a config default): `trainer.resume=auto` typed by the
    user, as the stop message says, may continue another run; the default `auto` of a fresh run never does."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task
    except (ImportError, ValueError):
        return False
    return any(str(o).lstrip("+~").startswith(f"{key}=") for o in overrides)


def _hydra_run_dir() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return None


def _hydra_job_name() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.name


def _hydra_chose_run_dir() -> bool:
    """Whether the run directory is Hydra's fresh `outputs/<experiment>/<time>` (not given by hydra.run.dir; the
    entry point pins the recipe's, config/entry.py)."""
    from rltrain.config.entry import run_dir_pinned

    if run_dir_pinned():
        return True
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.hydra
    except (ImportError, ValueError):
        return False
    return not any(str(o).lstrip("+~").startswith("hydra.run.dir=") for o in overrides)


def run_rl(cfg: RLConfig) -> None:
    """Check the run's files (prepare_run), and the tool sandbox first when the rollout runs tool calls (the log
    states its isolation once)."""
    from rltrain.trainer.setup import run_directory

    prepare_run(cfg, run_directory())
    if cfg.rollout.multi_turn.enable:
        from rltrain.rollout.multiturn import sandbox_isolation

        level = sandbox_isolation(allow_unisolated=cfg.sandbox.allow_unisolated, allow_exec=cfg.sandbox.allow_exec)
        print(f"rltrain: tool calls run in the sandbox with isolation: {level}", file=sys.stderr, flush=True)
    from rltrain.trainer.ppo import run_from_config

    run_from_config(cfg)  # a placement that does not fit (PlacementError) is a UserError: exit 2 in run_entry


@config_main(CONFIG_DIR, "grpo_tiny")  # a config Hydra or the schema refuses: exit 2 (config/entry.py)
def main(cfg: DictConfig) -> None:
    run_entry(cfg, validate_config, run_rl)


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
