"""The shell recipes under examples/: valid bash, and every rltrain command in them composes + validates.

Each script runs for real with `python`/`torchrun` replaced by a shim that records its arguments (nothing is
trained or downloaded); the recorded `-m rltrain.main|rltrain.sft --config-name X overrides...` commands are
then composed with Hydra and checked against the schema, exactly as the entry points would.
"""

import glob
import json
import os
import stat
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from rltrain.config import as_config, register_configs, validate_config
from rltrain.config.schema import RLConfig, SFTConfig
from rltrain.config.validate import validate_sft_config
from rltrain.main import CONFIG_DIR

register_configs()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "examples", "*", "*.sh")))
ENTRY_POINTS = {"rltrain.main": (RLConfig, validate_config), "rltrain.sft": (SFTConfig, validate_sft_config)}
SHIM = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["RECIPE_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def test_all_expected_recipes_exist():
    names = {os.path.relpath(s, ROOT) for s in SCRIPTS}
    assert {"examples/retool/retool_qwen3_4b_rl.sh", "examples/gsm8k/grpo_qwen3_0.6b.sh",
            "examples/gsm8k/ppo_qwen3_0.6b.sh", "examples/tiny/grpo_cpu.sh"} <= names


def _recorded_commands(script, tmp_path, **extra_env):
    shim = tmp_path / "shim"
    shim.write_text(SHIM)
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHON": str(shim), "TORCHRUN": str(shim), "RECIPE_LOG": str(log), **extra_env}
    res = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _parse(argv):
    """(module, config name, overrides) of a recorded `... -m module --config-name X k=v ...`, or None."""
    if "-m" not in argv or argv[argv.index("-m") + 1] not in ENTRY_POINTS:
        return None
    module, rest = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2:]
    name, overrides = None, []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--config-name":
            name, i = rest[i + 1], i + 2
            continue
        if a.startswith("--config-name="):
            name = a.split("=", 1)[1]
        elif not a.startswith("hydra."):
            overrides.append(a)
        i += 1
    assert name, f"no --config-name in {argv}"
    return module, name, overrides


def _learn_driver():
    import importlib.util

    spec = importlib.util.spec_from_file_location("learn_gpu", os.path.join(ROOT, "tools", "learn_gpu.py"))
    mod = sys.modules["learn_gpu"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.relpath(s, ROOT) for s in SCRIPTS])
def test_recipe_is_valid_bash_and_its_overrides_compose(script, tmp_path):
    subprocess.run(["bash", "-n", script], check=True)
    recorded = _recorded_commands(script, tmp_path)
    commands = [c for c in map(_parse, recorded) if c]
    drivers = [argv for argv in recorded if argv and argv[0].endswith("tools/learn_gpu.py")]
    assert commands or drivers, f"{script} runs no `python -m rltrain.main|rltrain.sft` command"
    for argv in drivers:  # the learning recipe's driver composes + validates every stage's trainer config
        assert _learn_driver().main([*argv[1:], "--dry-run"]) == 0, argv
    for module, name, overrides in commands:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            cfg = compose(config_name=name, overrides=overrides)
        schema, validate = ENTRY_POINTS[module]
        validate(as_config(cfg, schema))  # as run_entry converts and validates it


def test_retool_recipe_sets_the_published_knobs(tmp_path):
    script = os.path.join(ROOT, "examples", "retool", "retool_qwen3_4b_rl.sh")
    sft_out = str(tmp_path / "sft_hf")  # not there yet: the script runs the SFT stage first
    cmds = [c for c in map(_parse, _recorded_commands(script, tmp_path, SFT_OUT=sft_out)) if c]
    assert [m for m, _, _ in cmds] == ["rltrain.sft", "rltrain.main"]
    module, name, overrides = cmds[-1]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    assert (cfg.actor.clip_low, cfg.actor.clip_high) == (0.2, 0.28)
    assert not cfg.actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    assert cfg.rollout.n == 16 and cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.max_turns == 16
    assert cfg.rollout.max_response_length >= 8192 and cfg.reward.fn == "retool"
    assert cfg.trainer.logprobs_response_only and cfg.trainer.fused_linear_logprob
    assert cfg.model.path == cfg.model.tokenizer == sft_out and cfg.model.builtin is None
    sft_overrides = cmds[0][2]
    assert f"trainer.output_dir={sft_out}" in sft_overrides
