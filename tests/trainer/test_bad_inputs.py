"""User mistakes end with a clear message: missing model, malformed data row, a raising reward, a NaN loss.

Through the entry points (`rltrain.main`, `rltrain.sft`) a user's mistake is one `rltrain: ...` line naming
the key or file and the fix, and exit code 2; the real CLI is run for the exit code, the rest in-process.
"""

import json
import logging
import os
import subprocess
import sys

import pytest

from rltrain.config import validate_config
from rltrain.main import run_entry, run_rl
from rltrain.rewards import compute_rewards
from rltrain.trainer.ppo import TrainingDiverged, run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_missing_model_path_names_the_key(tmp_path, cfg_for):
    cfg = cfg_for("model.builtin=null", f"model.path={tmp_path}/no_such_model", "model.tokenizer=char")
    with pytest.raises(FileNotFoundError, match="model.path"):
        run_from_config(cfg, str(tmp_path / "run"))


def test_malformed_data_row_names_file_line_and_key(tmp_path, cfg_for):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "12=", "answer": "2"}, {"prompt": "34=", "answer": "4"}, {"question": "56=", "answer": "6"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = cfg_for("data.source=file", f"data.train_files=[{data}]", "reward.fn=synthetic")
    with pytest.raises(ValueError) as info:
        run_from_config(cfg, str(tmp_path / "run"))
    msg = str(info.value)
    assert "train.jsonl" in msg and "3" in msg and "prompt" in msg


def test_raising_reward_is_counted_and_scored_zero(tmp_path, cfg_for):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def reward(response, ground_truth, **kw):\n"
                  "    if int(ground_truth) % 2 == 0:\n"
                  "        raise RuntimeError('boom')\n"
                  "    return 0.5\n")
    run_dir = str(tmp_path / "run")
    # in process (trainer.use_ray=false): rewards are scored in the driver either way (trainer/ppo.py), and the
    # workers' start-up through Ray would double the test's time
    cfg = cfg_for(f"reward.fn={fn}:reward", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
                  "trainer.use_ray=false")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # rows with an even answer raised: counted, scored 0; the others scored 0.5
        assert r["reward/errors"] > 0
        assert r["critic/score/min"] == 0.0 and r["critic/score/max"] == 0.5


def test_nan_loss_stops_without_overwriting_last_good_checkpoint(tmp_path, ray_session, cfg_for):
    est = tmp_path / "nan_adv.py"
    est.write_text(
        "import os\n"
        "from rltrain.algorithms import compute_advantages\n"
        "MARK = os.path.join(os.path.dirname(__file__), 'called_once')\n"
        "def adv(token_rewards, response_mask, **kw):  # fine at step 1, NaN from step 2 on\n"
        "    a, r = compute_advantages('grpo', token_rewards, response_mask, group_ids=kw['group_ids'])\n"
        "    if os.path.exists(MARK):\n"
        "        a = a * float('nan')\n"
        "    open(MARK, 'w').close()\n"
        "    return a, r\n")
    run_dir = str(tmp_path / "run")
    cfg = cfg_for(f"algorithm.adv_estimator={est}:adv", "trainer.total_steps=3", "trainer.save_freq=1",
                  "trainer.test_freq=-1", "trainer.logger=[jsonl]")
    with pytest.raises(TrainingDiverged, match="step 2"):
        from rltrain.trainer.ppo import PPOTrainer

        PPOTrainer(cfg, run_dir).fit()
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ckpts == ["step_1"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]


# ------------------------------------------------------------------ through the entry points


def _cli(module, *overrides, cwd):
    """Run `python -m <module> <overrides>` as a user would; (exit code, stderr lines without warnings)."""
    cmd = [sys.executable, "-m", module, *overrides, f"hydra.run.dir={cwd}/run", "trainer.progress_bar=false"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RLTRAIN_TORCH_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    return res.returncode, lines


def test_cli_missing_data_file_is_one_line_and_exit_2(tmp_path):
    """The issue's example: today a Hydra traceback ending in ValueError."""
    code, lines = _cli("rltrain.main", "data.source=file", f"data.train_files=[{tmp_path}/x.jsonl]", cwd=tmp_path)
    assert code == 2, lines
    assert lines == [f"rltrain: data file '{tmp_path}/x.jsonl' does not exist; fix the path in data.train_files / "
                     "data.val_files"]


def test_cli_sft_malformed_data_file_is_one_line_and_exit_2(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [oops\n')
    code, lines = _cli("rltrain.sft", f"data.train_files=[{data}]", cwd=tmp_path)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"rltrain: {data}:2: not valid JSON"), lines


def test_cli_model_the_backend_cannot_honour_is_refused_at_trainer_start_with_exit_2(tmp_path):
    """A sliding window on some layer: the Megatron build refuses by name (rltrain/models/megatron/build.py)."""
    code, lines = _cli("rltrain.main", "trainer.use_ray=false",
                       "+model.overrides={use_sliding_window:true,sliding_window:8,max_window_layers:1}", cwd=tmp_path)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("rltrain: model config not supported: use_sliding_window=True"), lines
    assert "sliding_window=8" in lines[0] and "layers [1]" in lines[0]


def _entry_exit(cfg, capsys, monkeypatch, tmp_path):
    """run_entry as `python -m rltrain.main` runs it, in this process: (exit code, stderr lines)."""
    monkeypatch.chdir(tmp_path)  # the run directory outside Hydra is the current one
    with pytest.raises(SystemExit) as info:
        run_entry(cfg, validate_config, run_rl)
    return info.value.code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_malformed_data_file_names_file_and_line(tmp_path, cfg_for, capsys, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "12=", "answer": "2"}\n{"prompt": "34=", "answer": \n')
    cfg = cfg_for("data.source=file", f"data.train_files=[{data}]", "reward.fn=synthetic")
    code, lines = _entry_exit(cfg, capsys, monkeypatch, tmp_path)
    assert code == 2
    assert lines == [f"rltrain: {data}:2: not valid JSON (Expecting value); each line must be one JSON object "
                     "(JSON lines)"]


def test_missing_model_path_is_one_line_naming_the_key(tmp_path, cfg_for, capsys, monkeypatch):
    cfg = cfg_for("model.builtin=null", f"model.path={tmp_path}/no_such_model", "model.tokenizer=char")
    code, lines = _entry_exit(cfg, capsys, monkeypatch, tmp_path)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"rltrain: model.path='{tmp_path}/no_such_model' does not exist; fix model.path")


@pytest.mark.parametrize("source, error", [
    ("import no_such_module_for_rltrain\ndef f(r, g, **kw):\n    return 1.0\n",
     "failed (line 1): ModuleNotFoundError: No module named 'no_such_module_for_rltrain'"),
    ("def f(r, g, **kw):\n    return 1.0 +\n", "failed (line 2): SyntaxError: invalid syntax"),
    ("x = 1 / 0\n", "failed (line 1): ZeroDivisionError: division by zero"),
])
def test_reward_file_that_cannot_be_imported_is_one_line_naming_the_key(source, error, tmp_path, cfg_for, capsys,
                                                                        monkeypatch):
    fn = tmp_path / "my_reward.py"
    fn.write_text(source)
    cfg = cfg_for(f"reward.fn={fn}:f")
    code, lines = _entry_exit(cfg, capsys, monkeypatch, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"rltrain: reward.fn='{fn}:f': importing '{fn}' {error}")
    assert lines[0].endswith("; fix the file or install what it imports")


def test_reward_that_raises_on_every_call_is_reported_once_with_its_first_error(caplog):
    calls = []

    def always_raises(response, ground_truth, **kw):
        calls.append(response)
        raise RuntimeError(f"boom on {response!r}")

    with caplog.at_level(logging.DEBUG, logger="rltrain.rewards.runner"):
        for batch in (["a", "b", "c"], ["d", "e"]):
            scores, metrics = compute_rewards(always_raises, batch, ["1"] * len(batch), max_workers=0)
            assert scores == [0.0] * len(batch) and metrics["reward/errors"] == len(batch)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(calls) == 5 and len(warnings) == 1
    assert "failed on 3 of 3 calls" in warnings[0] and "first error: RuntimeError: boom on 'a'" in warnings[0]
    assert "reported once" in warnings[0]


def test_user_error_from_a_ray_worker_is_one_line_and_other_errors_keep_their_traceback(capsys):
    """Ray hands a worker's exception to the driver wrapped (RayTaskError(<cause type>), its str the remote
    traceback): the entry point prints the cause's message only. Anything that is not a user's mistake
    propagates unchanged."""
    from ray.exceptions import RayTaskError

    from rltrain.config.schema import RLConfig
    from rltrain.data.dataset import DataError

    cause = DataError("/data/x.jsonl:3: not valid JSON (Expecting value)")
    wrapped = RayTaskError("HybridWorker.setup", "Traceback (most recent call last):\n  ...\nDataError: ...",
                           cause).as_instanceof_cause()

    def run(cfg):
        raise wrapped

    with pytest.raises(SystemExit) as info:
        run_entry(RLConfig(), lambda cfg: None, run)
    assert info.value.code == 2
    assert capsys.readouterr().err == "rltrain: /data/x.jsonl:3: not valid JSON (Expecting value)\n"

    def bug(cfg):
        raise RuntimeError("a bug, not the user's mistake") from cause

    with pytest.raises(RuntimeError, match="a bug"):
        run_entry(RLConfig(), lambda cfg: None, bug)
