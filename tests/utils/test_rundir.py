"""The run directory: one live run per directory (an OS lock naming the holder), the run `trainer.resume=auto`
continues from a fresh Hydra run directory, the exact resume command, and a UserError out of a Ray actor's
constructor (ActorDiedError keeps only its text) recognized as the user's mistake."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from rltrain.utils import rundir
from rltrain.utils.checkpoint import save_checkpoint
from rltrain.utils.errors import UserError, find_user_error
from rltrain.utils.rundir import (FINISHED_FILE, RunDirLocked, find_previous_run, is_locked, lock_run_dir,
                                  mark_finished, resume_command)

HOLD = ("import sys, time\nfrom rltrain.utils.rundir import lock_run_dir\nlock_run_dir(sys.argv[1])\n"
        "print('locked', flush=True)\ntime.sleep(60)\n")


def _holder(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(tmp_path):
    proc = _holder(tmp_path / "run")
    try:
        assert is_locked(str(tmp_path / "run"))
        with pytest.raises(RunDirLocked) as info:
            lock_run_dir(str(tmp_path / "run"))
        msg = str(info.value)
        assert f"in use by a live run, pid {proc.pid}" in msg and "hydra.run.dir" in msg
        assert isinstance(info.value, UserError)
    finally:
        proc.kill()
        proc.wait()
    # the holder died (SIGKILL): the kernel dropped its lock, the directory is free again
    assert not is_locked(str(tmp_path / "run"))
    assert lock_run_dir(str(tmp_path / "run")).endswith(".rltrain.lock")
    assert lock_run_dir(str(tmp_path / "run"))  # this process again: fine
    assert json.load(open(tmp_path / "run" / ".rltrain.lock"))["pid"] == os.getpid()


def _fake_run(parent, name, *, step=None, total=5, experiment="exp", model=None, finished=False):
    d = parent / name
    d.mkdir(parents=True)
    cfg = {"trainer": {"experiment_name": experiment, "total_steps": total, "ckpt_dir": None},
           "model": model or {"path": None, "builtin": "tiny", "tokenizer": "char", "overrides": {}}}
    (d / "config.json").write_text(json.dumps(cfg))
    if step is not None:
        save_checkpoint(str(d / "checkpoints"), step,
                        lambda tmp: torch.save({"step": step}, os.path.join(tmp, "trainer_state.pt")))
    if finished:
        mark_finished(str(d))
    time.sleep(0.02)  # distinct start times (config.json mtimes)
    return d, cfg


def test_find_previous_run_takes_the_newest_unfinished_run_of_the_same_experiment_and_model(tmp_path):
    out = tmp_path / "outputs" / "exp"
    _fake_run(out, "2026-01-01_00-00-00", step=2)
    crashed, cfg = _fake_run(out, "2026-01-01_00-01-00", step=3)
    _fake_run(out, "2026-01-01_00-02-00", step=4, experiment="other")
    _fake_run(out, "2026-01-01_00-03-00")  # started, no checkpoint yet
    other_model = {"path": None, "builtin": "small", "tokenizer": "char", "overrides": {}}
    _fake_run(out, "2026-01-01_00-04-00", step=4, model=other_model)
    me = out / "2026-01-01_00-05-00"
    me.mkdir()
    logs = []
    found = find_previous_run(str(me), cfg, log=logs.append)
    assert found == (str(crashed), 3, str(crashed / "checkpoints" / "step_3"))
    assert any("another model" in ln and "model.builtin='small' -> 'tiny'" in ln for ln in logs), logs


def test_find_previous_run_stops_at_a_finished_run_and_skips_complete_or_live_ones(tmp_path):
    out = tmp_path / "outputs" / "exp"
    _, cfg = _fake_run(out, "a", step=3)
    _fake_run(out, "b", step=4, finished=True)
    me = out / "me"
    me.mkdir()
    assert find_previous_run(str(me), cfg, log=lambda m: None) is None  # b finished after a: a new run

    out2 = tmp_path / "outputs2" / "exp"
    _fake_run(out2, "a", step=2)
    _fake_run(out2, "b", step=5, total=5)  # its last checkpoint is its last step: nothing to continue
    live, _ = _fake_run(out2, "c", step=3)
    proc = _holder(live)
    try:
        logs = []
        found = find_previous_run(str(out2 / "me"), cfg, log=logs.append)
    finally:
        proc.kill()
        proc.wait()
    assert found is not None and found[0] == str(out2 / "a") and found[1] == 2
    assert any("a live run" in ln and f"pid {proc.pid}" in ln for ln in logs), logs


def test_resume_auto_without_a_run_dir_pins_the_stopped_run_unless_asked_for_a_new_one(tmp_path, monkeypatch,
                                                                                       capsys):
    """`... trainer.resume=auto` (no hydra.run.dir) hands Hydra the stopped run's own directory; with
    trainer.resume_in_place=false, or without trainer.resume on the command line, Hydra's fresh one."""
    from rltrain.config import entry

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(entry, "_PINNED", [])
    stopped, _ = _fake_run(tmp_path / "outputs" / "exp", "2026-01-01_00-00-00", step=2)
    argv = entry.pin_run_dir(entry.CONFIG_DIR, "grpo_tiny", ["trainer.experiment_name=exp", "trainer.resume=auto"],
                             "main")
    assert argv[-1] == f"hydra.run.dir='{stopped}'" and not entry.run_dir_pinned()
    assert os.listdir(stopped.parent) == [stopped.name]  # no fresh directory made
    assert f"continuing the run in {stopped} from its checkpoint of step 2, in its directory" in capsys.readouterr().err
    for asked in (["trainer.resume=auto", "trainer.resume_in_place=false"], []):
        argv = entry.pin_run_dir(entry.CONFIG_DIR, "grpo_tiny", ["trainer.experiment_name=exp", *asked], "main")
        fresh = argv[-1].split("=", 1)[1].strip("'")
        assert fresh != str(stopped) and os.path.dirname(fresh) == str(stopped.parent) and entry.run_dir_pinned()
        assert os.path.isdir(fresh)


def test_lock_clears_the_finished_mark(tmp_path):
    mark_finished(str(tmp_path))
    assert (tmp_path / FINISHED_FILE).exists()
    rundir._held.pop(os.path.realpath(str(tmp_path)), None)
    lock_run_dir(str(tmp_path))
    assert not (tmp_path / FINISHED_FILE).exists()


def test_resume_command_is_the_command_line_with_the_run_dir_and_auto(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["/repo/rltrain/main.py", "--config-name", "grpo_tiny", "actor.lr=1e-6",
                                      "trainer.resume=never", "hydra.run.dir=/elsewhere"])
    cmd = resume_command(str(tmp_path / "run dir"))
    assert cmd == (f"{sys.executable} -m rltrain.main --config-name grpo_tiny actor.lr=1e-6 "
                   f"'hydra.run.dir={tmp_path}/run dir' trainer.resume=auto")


def test_a_user_error_in_an_actor_constructor_is_found_in_actor_died_error():
    from ray.exceptions import ActorDiedError, RayTaskError

    from rltrain.data.dataset import DataError

    tb = ("Traceback (most recent call last):\n  File \"hybrid.py\", line 3, in __init__\n"
          "rltrain.data.dataset.DataError: /data/x.jsonl:3: not valid JSON (Expecting value); each line must be one "
          "JSON object (JSON lines)")
    died = ActorDiedError(RayTaskError("HybridWorker.__init__", tb, DataError("x")))
    found = find_user_error(died)
    assert isinstance(found, UserError)
    assert str(found) == ("/data/x.jsonl:3: not valid JSON (Expecting value); each line must be one JSON object "
                          "(JSON lines)")
    bug = ActorDiedError(RayTaskError("HybridWorker.__init__", tb.replace("rltrain.data.dataset.DataError",
                                                                          "KeyError"), KeyError("x")))
    assert find_user_error(bug) is None
    assert find_user_error(ActorDiedError()) is None  # a killed worker is not the user's mistake


def test_a_multi_line_user_error_message_is_found_whole_in_actor_died_error():
    from ray.exceptions import ActorDiedError, RayTaskError

    from rltrain.data.dataset import DataError

    tb = ("Traceback (most recent call last):\n  File \"hybrid.py\", line 3, in __init__\n"
          "rltrain.data.dataset.DataError: /data/x.jsonl: two problems\nnote: fix the first\nhint: then the second")
    found = find_user_error(ActorDiedError(RayTaskError("HybridWorker.__init__", tb, DataError("x"))))
    assert str(found) == "/data/x.jsonl: two problems\nnote: fix the first\nhint: then the second"
    chained = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n"
               "rltrain.data.dataset.DataError: bad row\n\nDuring handling of the above exception, another exception "
               "occurred:\n\nTraceback (most recent call last):\n  File \"b.py\", line 2, in g\nKeyError: 'x'")
    assert find_user_error(ActorDiedError(RayTaskError("HybridWorker.__init__", chained, KeyError("x")))) is None


def test_discard_unstarted_removes_only_a_directory_holding_what_starting_wrote(tmp_path):
    from rltrain.utils.rundir import LOCK_FILE, discard_unstarted

    def started(name, *extra):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "config.yaml").write_text("a: 1\n")
        (d / "checkpoints").mkdir()
        (d / "checkpoints" / LOCK_FILE).write_text("")
        for f in ("main.log", LOCK_FILE, "config.json", *extra):
            (d / f).write_text("x")
        return d

    fresh = started("fresh")
    assert discard_unstarted(str(fresh)) and not fresh.exists()
    ran = started("ran", "metrics.jsonl")  # a run that logged a step keeps its record
    assert not discard_unstarted(str(ran)) and (ran / "metrics.jsonl").exists()
    saved = started("saved")
    (saved / "checkpoints" / "step_1").mkdir()
    assert not discard_unstarted(str(saved)) and (saved / "checkpoints" / "step_1").exists()
    linked = started("linked")
    (linked / "main.log").unlink()
    (linked / "main.log").symlink_to(tmp_path / "elsewhere.log")
    assert not discard_unstarted(str(linked)) and (linked / ".hydra" / "config.yaml").exists()
    assert not discard_unstarted(str(tmp_path / "missing"))
