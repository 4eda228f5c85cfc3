"""Hydra entry point (thin): compose + validate the config, then hand it to the PPO/GRPO trainer.

Run: `python -m rltrain.main --config-name grpo_tiny` (CPU, no downloads) or `--config-name grpo_qwen3`;
any key can be overridden on the command line, e.g. `actor.lr=1e-6 trainer.fused_linear_logprob_backend=triton`.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from rltrain.config import ConfigError, register_configs, validate_config

register_configs()

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="grpo_tiny")
def main(cfg: DictConfig) -> None:
    try:
        validate_config(cfg)
    except ConfigError as err:
        print(f"rltrain: {err}", file=sys.stderr)
        sys.exit(2)
    from rltrain.trainer.ppo import run_from_config
    from rltrain.workers.placement import PlacementError

    try:
        run_from_config(cfg)
    except PlacementError as err:  # the placement asked for does not fit the config or the cluster
        print(f"rltrain: {err}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
