"""The distillation teacher (workers/teacher.py): its log-probs of a batch's response tokens equal a plain transformers
forward of the teacher's model (the reference computed another way), whatever the student is; a teacher of another
vocabulary (tokenizer, or fewer embedding rows) is refused before any worker starts, naming the key."""

import pytest
import torch

from rltrain.config.convert import as_config
from rltrain.config.schema import ActorConfig, ModelConfig, TeacherConfig, TrainerConfig
from rltrain.data.batch import Batch
from rltrain.data.tokenizer import CharTokenizer
from rltrain.models.hf_export import save_hf_checkpoint
from rltrain.workers.hybrid import initial_hf_model
from rltrain.workers.hybrid import build_teacher
from rltrain.workers.teacher import TeacherError, check_teacher

STUDENT = ModelConfig(builtin="tiny", tokenizer="char", dtype="float32")


def _write_model(directory, seed, *, tokenizer=None, **overrides):
    """A random tiny model (the student's shape unless overridden) saved as an HF directory; returns the model."""
    tok = CharTokenizer()
    hf_config, model = initial_hf_model(ModelConfig(builtin="tiny", overrides=overrides), tok, seed, torch.float32)
    save_hf_checkpoint(str(directory), hf_config, model.state_dict(), tokenizer=tokenizer or tok)
    return model


def _batch(gen):
    """Three rows: prompts left-padded, responses right-padded; row 1 has tool-output tokens (loss_mask 0), row 2 a
    one-token response."""
    prompt_lens, resp_lens = [3, 5, 1], [4, 6, 1]
    P, R = max(prompt_lens), max(resp_lens)
    prompt_ids = torch.zeros(3, P, dtype=torch.long)
    prompt_mask = torch.zeros(3, P, dtype=torch.long)
    response_ids = torch.zeros(3, R, dtype=torch.long)
    response_mask = torch.zeros(3, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        prompt_ids[i, P - p:] = torch.randint(8, 64, (p,), generator=gen)
        prompt_mask[i, P - p:] = 1
        response_ids[i, :r] = torch.randint(8, 64, (r,), generator=gen)
        response_mask[i, :r] = 1
    loss_mask = response_mask.clone()
    loss_mask[1, 2:4] = 0
    return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                 response_mask=response_mask, loss_mask=loss_mask)


def _hf_logprobs(model, batch):
    """log p(response token | everything before it) from a transformers forward of each row alone, [B, R]."""
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float64)
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        resp = batch.response_ids[i][batch.response_mask[i].bool()]
        ids = torch.cat([prompt, resp])[None]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].double(), -1)
        p = len(prompt)
        out[i, :len(resp)] = lp[p - 1:p - 1 + len(resp)].gather(-1, resp[:, None])[:, 0]
    return out


@pytest.fixture
def megatron_world():
    yield
    from rltrain.models.megatron.compat import teardown_parallel

    teardown_parallel()


def test_teacher_logprobs_equal_a_transformers_forward_of_the_teacher(tmp_path, megatron_world):
    gen = torch.Generator()
    print("seed", gen.seed())
    teacher_model = _write_model(tmp_path / "teacher", seed=int(torch.randint(0, 10**6, (), generator=gen)))
    teacher_cfg = TeacherConfig(path=str(tmp_path / "teacher"), dtype="float32")
    check_teacher(teacher_cfg, student=STUDENT, student_tokenizer=CharTokenizer(), actor=ActorConfig())  # accepted
    role = build_teacher(teacher_cfg, student=STUDENT, actor=ActorConfig(max_tokens_per_micro_batch=8),
                         trainer=as_config({"trainer": {"device": "cpu"}}).trainer, device="cpu", seed=1)
    batch = _batch(gen)
    got, _ = role.compute_logprobs(batch, temperature=1.0)
    want = _hf_logprobs(teacher_model, batch)
    torch.testing.assert_close(got.double(), want * batch.response_mask, atol=2e-5, rtol=0)
    assert bool((got[batch.response_mask == 0] == 0).all()) and float(got.abs().sum()) > 0


def test_a_teacher_of_another_vocabulary_is_refused_naming_the_key(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2},
                                                                              unk_token="<unk>")))
    _write_model(tmp_path / "other_vocab", seed=3, tokenizer=words)
    with pytest.raises(TeacherError, match=r"teacher\.path=.*3 tokens\) is not the student's \(char, 64 tokens"):
        check_teacher(TeacherConfig(path=str(tmp_path / "other_vocab")), student=STUDENT,
                      student_tokenizer=CharTokenizer(), actor=ActorConfig())
    # the student's tokenizer, but fewer embedding rows than the student's model: an id it samples has no row
    with pytest.raises(TeacherError, match=r"teacher\.builtin='tiny'.* 32 vocabulary rows, the student's 64"):
        check_teacher(TeacherConfig(builtin="tiny", overrides={"vocab_size": 32}), student=STUDENT,
                      student_tokenizer=CharTokenizer(), actor=ActorConfig())


def test_a_refused_teacher_stops_the_run_before_any_worker_starts(tmp_path):
    """The trainer's construction (in-process, no Ray) raises the TeacherError, a UserError (exit 2 at the command
    line), from check_model: no worker was built."""
    from rltrain.config.entry import compose_config
    from rltrain.trainer.ppo import PPOTrainer
    from rltrain.utils.errors import UserError

    cfg = compose_config("distill_tiny", ["teacher.builtin=tiny", "+teacher.overrides.vocab_size=32",
                                          "trainer.use_ray=false", "trainer.logger=[]"])
    with pytest.raises(TeacherError) as err:
        PPOTrainer(cfg, str(tmp_path))
    assert isinstance(err.value, UserError)
    with pytest.raises(TeacherError, match="does not exist|not a usable"):  # a path that names nothing
        check_teacher(TeacherConfig(path=str(tmp_path / "missing")), student=STUDENT,
                      student_tokenizer=CharTokenizer(), actor=ActorConfig())



def test_the_entry_point_refuses_a_teacher_of_another_vocabulary_with_exit_2(tmp_path, capsys):
    """rltrain.main's entry (run_entry: what `python -m rltrain.main --config-name distill_tiny teacher.path=DIR`
    runs) with DIR's tokenizer not the student's: exit code 2, one line naming teacher.path, no traceback, no step."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from rltrain.config import validate_config
    from rltrain.config.entry import compose_config
    from rltrain.main import run_entry
    from rltrain.trainer.ppo import run_from_config

    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "x": 1}, "<unk>")))
    _write_model(tmp_path / "teacher", seed=5, tokenizer=words)
    cfg = compose_config("distill_tiny", [f"teacher.path={tmp_path / 'teacher'}", "trainer.use_ray=false"])
    with pytest.raises(SystemExit) as stop:
        run_entry(cfg, validate_config, lambda c: run_from_config(c, str(tmp_path / "run")))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rltrain: teacher.path={str(tmp_path / 'teacher')!r}"), err
    assert "2 tokens) is not the student's (char, 64 tokens" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
