"""trainer.plan_check (#36): on a GPU run the trainer plans the config (rltrain.plan) at its training data's prompt
lengths, after the config checks and the datasets and before Ray or workers start; `error` stops with the planner's message and exit 2, `warn` prints it and
trains, `off` plans nothing; a CPU run plans nothing (the golden run is unchanged, tests/test_golden_run.py).

CPU-only: the GPU path is forced through plan_check's parameters (device, gpu_memory_gib), and for the real entry
point by replacing setup.py's device resolution and GPU-memory probe in the child process before main() runs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from rltrain.plan import PlanError
from rltrain.config.entry import compose_config as compose
from rltrain.trainer.setup import plan_check, plan_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = ["trainer.use_ray=false", "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.progress_bar=false"]

# the real entry point, with this machine taken for one GPU of `gib` GiB (only the planner sees the GPU: setup.py's
# build_workers resolves the device itself, so a `warn` run trains on CPU)
CHILD = """
import sys
import rltrain.trainer.setup as setup
gib = float(sys.argv.pop(1))
setup._resolved_device = lambda device: "cuda"
setup.gpu_memory = lambda: gib
from rltrain.main import main
main()
"""


# the three entry-point runs below, by name: (GPU GiB, overrides)
RUNS = {"refused": (0.5, ["trainer.plan_check=error"]), "warned": (0.5, ["trainer.plan_check=warn"]),
        "fits": (80.0, [])}  # trainer.plan_check=error is the default


@pytest.fixture(scope="module")
def main_runs(tmp_path_factory):
    """The runs of RUNS started at once (independent one-thread processes; each test reads its own) -> name ->
    (CompletedProcess with the stderr, run directory)."""
    d = tmp_path_factory.mktemp("plan_check")
    started = {}
    for name, (gib, overrides) in RUNS.items():
        with open(d / f"{name}.stderr", "w") as err:
            started[name] = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(gib), "--config-name", "grpo_tiny", *FAST, *overrides,
                 f"hydra.run.dir={d / name}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
    done = {}
    try:
        for name, proc in started.items():
            proc.wait(timeout=600)
            done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, None,
                                                      (d / f"{name}.stderr").read_text()), d / name)
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
    return done


def test_error_refuses_a_config_that_does_not_fit_with_exit_2(main_runs):
    res, run_dir = main_runs["refused"]
    assert res.returncode == 2, res.stderr[-3000:]
    assert "rltrain: the plan does not fit the GPUs (rltrain.plan): GPU 0 (actor, rollout) does not fit" in res.stderr
    assert "trainer.plan_check=warn" in res.stderr and "Traceback" not in res.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # stopped before any step


def test_warn_prints_the_refusal_and_trains(main_runs):
    res, run_dir = main_runs["warned"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rltrain: warning: trainer.plan_check=warn: the plan does not fit" in res.stderr
    assert "The run starts anyway." in res.stderr
    assert (run_dir / "metrics.jsonl").read_text().strip()


def test_error_passes_a_config_that_fits_and_prints_the_prediction_once(main_runs):
    res, _ = main_runs["fits"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("rltrain.plan: peak ") == 1 and "(fits)" in res.stderr
    # planned at the data the trainer loaded (the embedded task's 5-token prompts), not data.max_prompt_length's 32
    assert "sequences of 5 + 4 tokens (prompts: the data's longest; time at their mean, 5.0 tokens, of 4,096" in res.stderr


def _cfg(mode: str):
    return compose("grpo_tiny", [f"trainer.plan_check={mode}"])


def test_plan_check_modes_on_a_gpu(capsys):
    with pytest.raises(PlanError, match="GPU 0 .* does not fit"):
        plan_check(_cfg("error"), device="cuda", gpu_memory_gib=0.5)
    plan = plan_check(_cfg("warn"), device="cuda", gpu_memory_gib=0.5)
    assert plan is not None and not plan.fits
    assert "trainer.plan_check=warn" in capsys.readouterr().err
    assert plan_check(_cfg("off"), device="cuda", gpu_memory_gib=0.5) is None
    assert capsys.readouterr().err == ""  # off: nothing planned, nothing printed
    fits = plan_check(_cfg("error"), device="cuda", gpu_memory_gib=80.0)
    assert fits.fits and capsys.readouterr().err.count("rltrain.plan: peak ") == 1


def test_a_cpu_run_plans_nothing_and_says_so_at_debug_level(capsys, caplog):
    with caplog.at_level(logging.DEBUG, logger="rltrain.trainer.setup"):
        assert plan_check(_cfg("error"), gpu_memory_gib=0.5) is None  # grpo_tiny: trainer.device=cpu
    assert "CPU run" in caplog.text and capsys.readouterr().err == ""
    assert plan_metrics(None) == {}  # so no perf/plan_* key on CPU


def test_plan_metrics_name_every_gpu_beside_the_measured_peaks():
    plan = plan_check(compose("grpo_tiny", ["trainer.n_gpus_per_node=2"]), device="cuda", gpu_memory_gib=80.0)
    m = plan_metrics(plan)
    keys = ("max_memory_allocated_gb", "max_memory_reserved_gb", "peak_gib")
    assert set(m) == {f"perf/plan_{k}/gpu{i}" for k in keys for i in (0, 1)}
    assert all(0 < v < 80 for v in m.values())
    for i in (0, 1):  # the caching allocator's slack: reserved >= allocated (grpo_tiny's hf engine: no vLLM pool)
        assert m[f"perf/plan_max_memory_reserved_gb/gpu{i}"] >= m[f"perf/plan_max_memory_allocated_gb/gpu{i}"]


def test_the_config_and_room_checks_run_before_any_data_or_tokenizer_work(tmp_path):
    """check_config (config/'s rules and the rooms': here rollout.ENGINES) refuses before build_datasets would
    open data.train_files (missing here) or load a tokenizer."""
    from rltrain.config.validate import ConfigError
    from rltrain.trainer.ppo import PPOTrainer

    cfg = compose("grpo_tiny", ["data.source=file", f"data.train_files=[{tmp_path / 'missing.jsonl'}]",
                                "rollout.engine=nope"])
    with pytest.raises(ConfigError, match="rollout.engine='nope' is not allowed"):
        PPOTrainer(cfg, str(tmp_path / "run"))


def test_gpu_memory_without_a_readable_gpu_warns_and_plans_for_the_default(capsys):
    import torch

    from rltrain.trainer.setup import gpu_memory

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: its memory is readable")
    assert gpu_memory() is None  # the child's torch finds no GPU
    assert "cannot read GPU 0's memory" in capsys.readouterr().err


def test_an_unknown_plan_check_mode_is_refused_naming_the_key():
    from rltrain.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"trainer.plan_check='maybe' is not allowed; choose one of error, warn, off"):
        validate_config(compose("grpo_tiny", ["trainer.plan_check=maybe"]))
