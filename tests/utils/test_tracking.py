import glob
import io
import json
import math
import os
import sys

import pytest

from rltrain.utils.plotting import plot_run
from rltrain.utils.tracking import Tracker, read_metrics


def test_tracker_writes_jsonl_console_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = io.StringIO()
    run_dir = str(tmp_path / "run")
    tr = Tracker(["console", "jsonl", "wandb"], run_dir, project="rltrain-test", experiment="t",
                 config={"a": 1}, console_stream=out)
    assert tr.wandb_run.settings.mode == "offline"
    tr.log({"critic/score/mean": 0.25, "actor/entropy": 1.5, "timing_s/step": 2.0}, step=1)
    tr.log({"critic/score/mean": 0.5, "actor/grad_norm": float("nan")}, step=2)
    tr.finish()

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["critic/score/mean"] == 0.25 and rows[0]["actor/entropy"] == 1.5
    assert rows[1]["actor/grad_norm"] == "nan"  # non-finite kept visible, file stays valid JSON
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert all(json.loads(line) for line in f)
    assert "reward=0.25" in out.getvalue() and "step 2" in out.getvalue()
    # a real offline wandb run directory with its binary log
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1
    assert glob.glob(os.path.join(runs[0], "*.wandb"))


def test_unknown_logger_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="tensorboard"):
        Tracker(["console", "tensorboard"], str(tmp_path))


def test_plot_run_writes_pngs(tmp_path):
    run_dir = str(tmp_path)
    with Tracker(["jsonl"], run_dir) as tr:
        for s in range(5):
            tr.log({"critic/score/mean": s / 4, "actor/entropy": 2 - s / 5, "response_length/mean": 3.0,
                    "actor/grad_norm": math.sqrt(s + 1)}, step=s)
    paths = plot_run(run_dir)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["entropy.png", "grad_norm.png", "response_length.png", "reward.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plotting_command_redraws_a_run_and_refuses_a_folder_without_metrics(tmp_path, capsys):
    from rltrain.utils.plotting import main

    with Tracker(["jsonl"], str(tmp_path)) as tr:
        tr.log({"critic/score/mean": 0.5}, step=1)
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "reward.png")]
    assert main([str(tmp_path / "nothing")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_piped_progress_bar_writes_nothing_and_sft_lines_show_the_loss(capsys):
    """In a piped log (stderr not a terminal) the bar draws nothing, however many steps; the step line carries
    what the bar would have (SFT's loss and step time)."""
    from rltrain.utils.tracking import ConsoleLogger, progress_bar

    bar = progress_bar(300, 0, "rltrain sft")
    for _ in range(300):
        bar.set_postfix(loss="0.1")
        bar.update(1)
    bar.close()
    assert capsys.readouterr().err == ""
    out = io.StringIO()
    ConsoleLogger(out).log({"sft/loss": 0.25, "sft/val_loss": 0.5, "timing_s/step": 0.125, "sft/epoch": 1}, step=7)
    assert out.getvalue() == "step 7 | loss=0.25 | val_loss=0.5 | step_s=0.125\n"


class _FakeWandb:
    """A stand-in for the wandb module: records each init's arguments; a run resumed by id has seen `server_step`
    steps (what the wandb server would report)."""

    def __init__(self, server_step=0):
        self.inits, self.logged, self.server_step = [], [], server_step

    def init(self, **kw):
        self.inits.append(kw)
        fake = self

        class Run:
            id = kw["id"] or f"new{len(fake.inits)}"
            step = fake.server_step if kw["resume"] else 0

            def log(self, row, step):
                fake.logged.append((self.id, step))

            def finish(self):
                pass

        return Run()


def test_a_resume_in_the_same_directory_keeps_one_metrics_file_and_the_wandb_run(tmp_path, monkeypatch):
    """A run stopped after step 3 with its checkpoint at step 2 continues: metrics.jsonl keeps steps 0-2 (and drops
    step 3, which runs again, and a row cut short by a kill), the wandb run of the directory continues by its id,
    and steps the wandb server already holds are not sent again; a fresh start there starts both anew."""
    fake = _FakeWandb(server_step=4)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = str(tmp_path)
    with Tracker(["jsonl", "wandb"], run_dir) as tr:
        for step in range(4):
            tr.log({"critic/score/mean": step / 10}, step=step)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "critic/sco')  # killed while writing step 4's row
    (first_id,) = {run_id for run_id, _ in fake.logged}
    assert fake.inits[0]["id"] is None and fake.inits[0]["resume"] is None

    with Tracker(["jsonl", "wandb"], run_dir, start_step=2) as tr:
        for step in (3, 4, 5):
            tr.log({"critic/score/mean": step / 10 + 1}, step=step)
    assert fake.inits[1]["id"] == first_id and fake.inits[1]["resume"] == "allow"
    assert fake.logged[4:] == [(first_id, 4), (first_id, 5)]  # step 3 is the server's already (server_step 4)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["critic/score/mean"]) for r in rows] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 1.3), (4, 1.4),
                                                                    (5, 1.5)]

    with Tracker(["jsonl", "wandb"], run_dir, start_step=0) as tr:  # trainer.resume=never in the same directory
        tr.log({"critic/score/mean": 0.5}, step=1)
    assert fake.inits[2]["id"] is None and fake.logged[-1] == ("new3", 1)
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    with Tracker(["wandb"], run_dir, start_step=1):  # the directory now names the new wandb run
        pass
    assert fake.inits[3]["id"] == "new3"
