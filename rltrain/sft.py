"""Hydra entry point (thin) for supervised fine-tuning: compose + validate an SFT config, then train.

Run: `python -m rltrain.sft --config-name retool_tiny_sft` (CPU, no downloads; prepare the data first with
`python -m rltrain.data.retool_synthetic --out data/retool_tiny`), or on GPUs
`torchrun --nproc_per_node=8 -m rltrain.sft --config-name sft_qwen3_4b`. Any key can be overridden:
`optim.lr=1e-5 trainer.total_steps=100`. It does no RL: see rltrain/main.py for that.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from rltrain.config import register_configs
from rltrain.config.validate import validate_sft_config
from rltrain.main import CONFIG_DIR, run_entry

register_configs()


def run_sft(cfg: DictConfig) -> None:
    """A local model.path with missing or truncated weights is refused before training (exit 2)."""
    from rltrain.trainer.sft import run_sft_from_config

    if cfg.model.builtin is None and cfg.model.path:
        from rltrain.models.checkpoint_files import check_model_dir

        check_model_dir(cfg.model.path)

    run_sft_from_config(cfg)


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="retool_tiny_sft")
def main(cfg: DictConfig) -> None:
    run_entry(cfg, validate_sft_config, run_sft)


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
