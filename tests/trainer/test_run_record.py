"""A run's record: Ctrl-C ends a run with one line naming its last checkpoint and the exact resume command, and the
step lines the console shows are in the run directory's main.log (the root logger's file handler, as Hydra opens)."""

import logging

import pytest

from rltrain.trainer.ppo import run_from_config
from rltrain.utils.rundir import resume_command


def test_ctrl_c_prints_one_resume_line_and_main_log_holds_the_steps(tmp_path, cfg_for, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log_file = logging.FileHandler(run_dir / "main.log")
    logging.getLogger().addHandler(log_file)
    monkeypatch.setattr("sys.argv", ["rltrain/main.py", "--config-name", "grpo_tiny", "trainer.save_freq=1"])
    cfg = cfg_for("trainer.use_ray=false", "trainer.total_steps=10", "trainer.test_freq=-1", "trainer.save_freq=1",
                  "trainer.logger=[console,jsonl]", "trainer.plots=false")

    def interrupt(step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt

    try:
        with pytest.raises(SystemExit) as stop:
            run_from_config(cfg, str(run_dir), after_step=interrupt)
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    assert stop.value.code == 130
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert lines == [f"rltrain: interrupted at step 2; the last good checkpoint is {run_dir}/checkpoints/step_2 "
                     f"(step 2); resume with: {resume_command(str(run_dir))}"]
    assert "Traceback" not in err
    assert lines[0].endswith(f"hydra.run.dir={run_dir} trainer.resume=auto")
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split(" |")[0] for s in steps] == ["step 1", "step 2"]
    logged = (run_dir / "main.log").read_text().splitlines()
    assert logged == [*steps, lines[0]]
