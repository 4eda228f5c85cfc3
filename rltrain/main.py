"""Hydra entry point (thin): compose + validate the config, then hand it to the PPO/GRPO trainer.

Run: `python -m rltrain.main --config-name grpo_tiny` (CPU, no downloads) or `--config-name grpo_qwen3`;
any key can be overridden on the command line, e.g. `actor.lr=1e-6 trainer.fused_linear_logprob_backend=triton`.
A user's mistake (bad key, missing file, unsupported model, no sandbox isolation) ends as one message and exit 2.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import hydra
from omegaconf import DictConfig

from rltrain.config import register_configs, validate_config
from rltrain.utils.errors import find_user_error
from rltrain.utils.stacks import enable_stack_dumps

register_configs()

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def run_entry(cfg: DictConfig, validate: Callable[[DictConfig], None], run: Callable[[DictConfig], object]) -> None:
    """Validate and run `cfg` for an entry point (this one and rltrain.sft). A user's mistake (a
    UserError, raised here or in a Ray worker) is printed as `rltrain: <message>` and exits with code 2,
    never as a traceback; anything else propagates. `kill -USR1 <pid>` prints the process's stacks
    (utils/stacks.py)."""
    enable_stack_dumps()
    try:
        validate(cfg)
        run(cfg)
    except Exception as err:
        user_error = find_user_error(err)
        if user_error is None:
            raise
        print(f"rltrain: {user_error}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_rl(cfg: DictConfig) -> None:
    """Check the tool sandbox first when the rollout runs tool calls (the log states its isolation once)."""
    if cfg.rollout.multi_turn.enable:
        from rltrain.rollout.multiturn import sandbox_isolation

        level = sandbox_isolation(allow_unisolated=cfg.sandbox.allow_unisolated, allow_exec=cfg.sandbox.allow_exec)
        print(f"rltrain: tool calls run in the sandbox with isolation: {level}", file=sys.stderr, flush=True)
    from rltrain.trainer.ppo import run_from_config

    run_from_config(cfg)  # a placement that does not fit (PlacementError) is a UserError: exit 2 in run_entry


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="grpo_tiny")
def main(cfg: DictConfig) -> None:
    run_entry(cfg, validate_config, run_rl)


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
