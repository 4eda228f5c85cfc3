"""Issue #38, run directory / checkpoints / input files, through the entry point: a second run on a live run's
directory exits 2 naming its pid; `trainer.resume=auto` without hydra.run.dir continues the killed run in its
directory; a checkpoint directory that cannot be written, a broken or foreign resume checkpoint, a model directory
without weights, an empty data file and a reward module that exits at import end as one line and exit 2 before
any training step; a full disk during a save ends with exit 2 and keeps the last good checkpoint."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from rltrain.config import validate_config
from rltrain.config.schema import RLConfig, SFTConfig
from rltrain.main import CONFIG_DIR, prepare_run, run_entry, run_rl
from rltrain.utils.checkpoint import save_checkpoint
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(CONFIG_DIR)
QUICK = ["trainer.progress_bar=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.use_ray=false",
         "trainer.plots=false", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2"]


def _env():
    return {**os.environ, "PYTHONWARNINGS": "ignore", "RLTRAIN_TORCH_THREADS": "1", "WANDB_MODE": "offline"}


# `python -m rltrain.main ...` that SIGKILLs itself right after the checkpoint of step N is sealed (the crash)
KILLED_AFTER_SAVE = """
import os, signal, sys
kill_after = int(sys.argv.pop(1))
from rltrain.trainer import ppo
sealed = ppo.save_checkpoint
def save_then_die(root, step, write, **kw):
    path = sealed(root, step, write, **kw)
    if step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    return path
ppo.save_checkpoint = save_then_die
from rltrain.main import main
main()
"""


def _cmd(*overrides):
    return [sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", *QUICK, *overrides]


def _lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("rltrain:")]


@pytest.mark.slow
def test_second_run_on_a_live_runs_directory_exits_2_naming_its_pid(tmp_path):
    """Run A holds the directory (its reward module waits at import for the test's go-ahead, so A is surely
    live when B starts); B exits 2 naming A's pid; A then trains its steps once each and exits 0."""
    go = tmp_path / "go"
    reward = tmp_path / "gated_reward.py"
    reward.write_text("import os, time\nfrom rltrain.rewards import REWARD_FNS\n"
                      f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.1)\n"
                      "def score(*a, **kw):\n    return REWARD_FNS['synthetic'](*a, **kw)\n")
    run_dir = tmp_path / "run"
    args = _cmd("trainer.total_steps=2", f"reward.fn={reward}:score", f"hydra.run.dir={run_dir}",
                "trainer.resume=auto")  # typed by the user, with nothing to resume: said so
    a = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if json.load(open(run_dir / ".rltrain.lock"))["pid"] == a.pid:
                    break
            except (OSError, ValueError):
                pass
            assert a.poll() is None, a.communicate()[1][-3000:]
            time.sleep(0.2)
        b = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        assert b.returncode == 2, b.stderr[-3000:]
        assert len(_lines(b.stderr)) == 1, b.stderr[-3000:]
        assert _lines(b.stderr)[0].startswith(f"rltrain: the run directory {run_dir} is in use by a live run, "
                                              f"pid {a.pid}")
    finally:
        go.write_text("")
    _, err = a.communicate(timeout=300)
    assert a.returncode == 0, err[-3000:]
    assert (f"rltrain: warning: trainer.resume=auto found no intact checkpoint in {run_dir}/checkpoints; training "
            "starts at step 1") in err
    assert [r["step"] for r in read_metrics(str(run_dir))] == [1, 2]  # each step once: B wrote nothing


@pytest.mark.slow
def test_resume_auto_without_a_run_dir_continues_the_killed_run_in_its_directory(tmp_path):
    """What the stop message says to do, done as written: the same command plus trainer.resume=auto (no
    hydra.run.dir: Hydra would pick a new outputs/<experiment>/<time>) continues from the killed run's last
    checkpoint in the killed run's own directory: one directory, one metrics.jsonl with each step once.
    (trainer.resume_in_place=false, a new directory instead: tests/utils/test_rundir.py.)"""
    base = _cmd("trainer.experiment_name=resume_auto", "trainer.total_steps=3", "trainer.save_freq=1")
    first = subprocess.run([sys.executable, "-c", KILLED_AFTER_SAVE, "2", *base[3:]], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == -9, first.stderr[-3000:]
    (killed,) = os.listdir(tmp_path / "outputs" / "resume_auto")
    killed = tmp_path / "outputs" / "resume_auto" / killed
    assert sorted(n for n in os.listdir(killed / "checkpoints") if n != ".rltrain.lock") == ["step_1", "step_2"]
    time.sleep(1.1)  # Hydra's directory names have one-second resolution: a new one would differ
    second = subprocess.run([*base, "trainer.resume=auto"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert os.listdir(tmp_path / "outputs" / "resume_auto") == [killed.name]
    assert (f"rltrain: trainer.resume=auto: continuing the run in {killed} from its checkpoint of step 2, in its "
            "directory") in second.stderr
    assert f"resumed from {killed}/checkpoints/step_2 (step 2)" in second.stderr
    with open(killed / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    assert sorted(n for n in os.listdir(killed / "checkpoints") if n != ".rltrain.lock") == ["step_2", "step_3"]


# ------------------------------------------------------------------ in process, stopped before any training step


def _entry(cfg, capsys, monkeypatch, run_dir):
    """run_entry as `python -m rltrain.main` runs it (the run directory outside Hydra is the current one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(run_dir)
    with pytest.raises(SystemExit) as info:
        run_entry(cfg, validate_config, run_rl)
    return info.value.code, [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rltrain:")]


def test_a_checkpoint_dir_that_is_a_file_is_refused_at_start(tmp_path, cfg_for, capsys, monkeypatch):
    f = tmp_path / "ckpt"
    f.write_text("")
    cfg = cfg_for(*QUICK, f"trainer.ckpt_dir={f}", "trainer.save_freq=1", "trainer.total_steps=2")
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    assert code == 2 and lines == [f"rltrain: checkpoint directory {f} is a file, not a directory; remove it or set "
                                   "trainer.ckpt_dir to a writable directory (or fix its permissions)"]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # no step ran


def _checkpoint(root, step, model="tiny"):
    """A checkpoint as the trainer lays it out: <run>/checkpoints/step_N, the run's config.json next to it."""
    os.makedirs(root / "checkpoints", exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model": {"builtin": model, "path": None, "tokenizer": "char",
                                                            "overrides": {}}, "trainer": {"total_steps": 9}}))

    def write(tmp):
        torch.save({"actor": {}}, os.path.join(tmp, "worker_rank0.pt"))
        torch.save({"step": step, "next_group_id": 0, "sampler": {"epoch": 0, "position": 0}, "rng": {}},
                   os.path.join(tmp, "trainer_state.pt"))

    return save_checkpoint(str(root / "checkpoints"), step, write)


def test_resume_path_broken_or_of_another_model_is_one_line(tmp_path, cfg_for, capsys, monkeypatch):
    path = _checkpoint(tmp_path / "old", 2, model="small")
    cfg = cfg_for(*QUICK, f"trainer.resume={path}")
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"rltrain: trainer.resume='{path}' (step 2) was saved by a run of another model "
                               "(model.builtin='small' -> 'tiny')")
    os.truncate(os.path.join(path, "worker_rank0.pt"), 10)
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"rltrain: trainer.resume='{path}' is not a usable checkpoint: file worker_rank0.pt "
                               "has 10 bytes")


def test_resume_auto_refuses_its_own_checkpoint_of_another_model(tmp_path, cfg_for, capsys, monkeypatch):
    path = _checkpoint(tmp_path / "run", 2, model="small")
    cfg = cfg_for(*QUICK)  # trainer.resume=auto, the run directory is tmp_path/run
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"rltrain: trainer.resume=auto would continue {path}, which was saved by a run of "
                               "another model")


def test_model_dir_without_weights_is_one_line(tmp_path, cfg_for, capsys, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    cfg = cfg_for(*QUICK, "model.builtin=null", f"model.path={model}", "model.tokenizer=char")
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    assert code == 2 and lines == [f"rltrain: model.path='{model}': no *.safetensors weight files in the directory; "
                                   "fix model.path (a directory with config.json and *.safetensors weights) or "
                                   "download the model again"]


def test_empty_data_file_and_exiting_reward_are_one_line(tmp_path, cfg_for, capsys, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg = cfg_for(*QUICK, "data.source=file", f"data.train_files=[{data}]", "reward.fn=synthetic")
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    assert code == 2 and lines == [f"rltrain: data file '{data}' holds no rows (it is empty); give a file with "
                                   "prompts in data.train_files / data.val_files"]
    reward = tmp_path / "exits.py"
    reward.write_text("import sys\nsys.exit(0)\n")
    cfg = cfg_for(*QUICK, f"reward.fn={reward}:f")
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run2")
    assert code == 2 and len(lines) == 1 and "called sys.exit(0), which would end the run" in lines[0], lines


def test_prepare_run_removes_stale_temp_dirs_of_crashed_runs(tmp_path, cfg_for):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "run" / "checkpoints" / f".tmp_step_4_{int(dead.stdout)}"
    stale.mkdir(parents=True)
    prepare_run(cfg_for(*QUICK, "trainer.save_freq=1"), str(tmp_path / "run"))
    assert not stale.exists()


def test_worker_lost_stop_prints_the_exact_resume_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/x/rltrain/main.py", "--config-name", "grpo_tiny", "trainer.save_freq=1"])

    def lost(cfg):
        raise SystemExit(4)

    with pytest.raises(SystemExit) as info:
        run_entry(RLConfig(), lambda cfg: None, lost)
    assert info.value.code == 4
    assert capsys.readouterr().err == (f"rltrain: to continue in this run directory, run exactly: {sys.executable} -m "
                                       f"rltrain.main --config-name grpo_tiny trainer.save_freq=1 "
                                       f"hydra.run.dir={tmp_path} trainer.resume=auto\n")


@pytest.mark.slow
def test_disk_full_during_a_save_exits_2_and_keeps_the_last_checkpoint(tmp_path, cfg_for, capsys, monkeypatch):
    """The worker's torch.save of step 2 goes to a device that is always full (/dev/full): torch's own error."""
    from rltrain.workers.hybrid import HybridWorker

    real_save = HybridWorker.save

    def save(self, path):
        if ".tmp_step_2_" in path:
            os.symlink("/dev/full", os.path.join(path, f"worker_rank{self.rank}.pt"))
        return real_save(self, path)

    monkeypatch.setattr(HybridWorker, "save", save)
    cfg = cfg_for(*QUICK, "trainer.save_freq=1", "trainer.total_steps=3")
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    assert code == 2 and len(lines) == 2, lines
    assert lines[0] == f"rltrain: saved checkpoint {ckpts}/step_1"
    assert lines[1].startswith(f"rltrain: saving the checkpoint of step 2 under {ckpts} failed")
    assert "GiB free of" in lines[1] and "earlier checkpoints are intact" in lines[1]
    assert sorted(os.listdir(ckpts)) == [".rltrain.lock", "step_1"] or sorted(os.listdir(ckpts)) == ["step_1"]


@pytest.mark.slow
def test_resume_auto_from_a_checkpoint_of_another_shape_is_one_line(tmp_path, cfg_for, capsys, monkeypatch):
    """No run config next to it (trainer.ckpt_dir): the workers' load itself fails, and says which checkpoint."""
    ckpts = tmp_path / "ckpts"

    def write(tmp):
        torch.save({"actor": {"model": {"decoder.final_layernorm.weight": torch.ones(3)}}},
                   os.path.join(tmp, "worker_rank0.pt"))
        torch.save({"step": 1, "next_group_id": 0, "sampler": {"epoch": 0, "position": 0}, "rng": {}},
                   os.path.join(tmp, "trainer_state.pt"))

    path = save_checkpoint(str(ckpts), 1, write)
    cfg = cfg_for(*QUICK, f"trainer.ckpt_dir={ckpts}", "trainer.total_steps=2")
    code, lines = _entry(cfg, capsys, monkeypatch, tmp_path / "run")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"rltrain: cannot resume from checkpoint {path}: it holds a model of another shape "
                               "or parallel layout than this config builds")
    run = tmp_path / "run"
    assert not os.path.exists(run / "metrics.jsonl") or read_metrics(str(run)) == []  # no step ran


def test_sft_from_a_truncated_model_dir_is_one_line(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    from hydra import compose, initialize_config_dir

    from rltrain.config.validate import validate_sft_config
    from rltrain.sft import run_sft

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    save_file({"w": torch.zeros(32, 32)}, str(model / "model.safetensors"))
    os.truncate(model / "model.safetensors", 200)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="retool_tiny_sft", overrides=["model.builtin=null", f"model.path={model}",
                                                                 "model.tokenizer=char", "trainer.progress_bar=false"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        run_entry(cfg, validate_sft_config, run_sft, SFTConfig)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rltrain:")]
    assert info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"rltrain: model.path='{model}': model.safetensors is truncated")


def test_sft_checkpoint_dir_that_is_a_file_or_a_broken_resume_is_one_line(tmp_path, capsys, monkeypatch):
    from hydra import compose, initialize_config_dir

    from rltrain.config.validate import validate_sft_config
    from rltrain.sft import run_sft

    f = tmp_path / "ckpt"
    f.write_text("")
    broken = tmp_path / "step_3"
    broken.mkdir()
    monkeypatch.chdir(tmp_path)
    for override, want in [([f"trainer.ckpt_dir={f}", "trainer.save_freq=1"],
                            f"rltrain: checkpoint directory {f} is a file, not a directory"),
                           ([f"trainer.resume={broken}"],
                            f"rltrain: trainer.resume='{broken}' is not a usable checkpoint: no manifest")]:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            cfg = compose(config_name="retool_tiny_sft", overrides=[*override, "trainer.progress_bar=false"])
        with pytest.raises(SystemExit) as info:
            run_entry(cfg, validate_sft_config, run_sft, SFTConfig)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rltrain:")]
        assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith(want), lines


def test_a_checkpoint_dir_a_live_run_writes_is_refused(tmp_path, cfg_for):
    """Two run directories, one trainer.ckpt_dir: the second run is refused before it writes a checkpoint."""
    from rltrain.utils.rundir import RunDirLocked

    ckpts = tmp_path / "shared_ckpt"
    hold = ("import sys, time\nfrom rltrain.utils.rundir import lock_run_dir\n"
            "lock_run_dir(sys.argv[1], what='checkpoint directory')\nprint('locked', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(ckpts)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLocked, match=f"the checkpoint directory {ckpts} is in use by a live run, pid "
                                               f"{proc.pid}.*trainer.ckpt_dir=..."):
            prepare_run(cfg_for(*QUICK, f"trainer.ckpt_dir={ckpts}", "trainer.save_freq=1"), str(tmp_path / "run"))
    finally:
        proc.kill()
        proc.wait()
