"""Hydra entry point (thin) for supervised fine-tuning: compose + validate an SFT config, then train.

Run: `python -m rltrain.sft --config-name retool_tiny_sft` (CPU, no downloads; prepare the data first with
`python -m rltrain.data.retool_synthetic --out data/retool_tiny`), or on GPUs
`torchrun --nproc_per_node=8 -m rltrain.sft --config-name sft_qwen3_4b`. Any key can be overridden:
`optim.lr=1e-5 trainer.total_steps=100`. It does no RL: see rltrain/main.py for that.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from rltrain.config import ConfigError, register_configs
from rltrain.config.validate import validate_sft_config
from rltrain.main import CONFIG_DIR

register_configs()


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="retool_tiny_sft")
def main(cfg: DictConfig) -> None:
    try:
        validate_sft_config(cfg)
    except ConfigError as err:
        print(f"rltrain: {err}", file=sys.stderr)
        sys.exit(2)
    from rltrain.trainer.sft import run_sft_from_config

    run_sft_from_config(cfg)


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
