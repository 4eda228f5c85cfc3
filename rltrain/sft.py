"""Hydra entry point (thin) for supervised fine-tuning: compose + validate an SFT config, then train.

Run: `python -m rltrain.sft --config-name retool_tiny_sft` (CPU, no downloads; prepare the data first with
`python -m rltrain.data.retool_synthetic --out data/retool_tiny`), or on GPUs
`torchrun --nproc_per_node=8 -m rltrain.sft --config-name sft_qwen3_4b`. Any key can be overridden:
`optim.lr=1e-5 trainer.total_steps=100`. It does no RL: see rltrain/main.py for that.
"""

from __future__ import annotations

from omegaconf import DictConfig

from rltrain.config import config_main, register_configs
from rltrain.config.schema import SFTConfig
from rltrain.config.validate import validate_sft_config
from rltrain.main import CONFIG_DIR, run_entry

register_configs()


def run_sft(cfg: SFTConfig) -> None:
    """Refused before training (exit 2): a local model.path with missing or truncated weights, a checkpoint
    directory that cannot be written or that another local user owns or can write, a trainer.resume=PATH that is
    not an intact checkpoint of yours. Rank 0 locks the checkpoint directory and removes crashed runs' temp dirs
    from it (rltrain.main.run_entry holds the run's lock)."""
    import os

    from rltrain.trainer.sft import run_sft_from_config
    from rltrain.trainer.setup import run_directory
    from rltrain.utils.checkpoint import check_writable, resume_path
    from rltrain.utils.rundir import claim_checkpoint_dir

    if cfg.model.builtin is None and cfg.model.path:
        from rltrain.models.checkpoint_files import check_model_dir

        check_model_dir(cfg.model.path)
    t = cfg.trainer
    ckpt_dir = t.ckpt_dir or os.path.join(run_directory(), "checkpoints")
    if os.environ.get("RANK", "0") == "0":
        claim_checkpoint_dir(ckpt_dir, run_directory(), save=t.save_freq > 0)
    elif t.save_freq > 0:
        check_writable(ckpt_dir)
    if t.resume not in ("auto", "never"):
        resume_path(t.resume, ckpt_dir)  # a broken PATH: CheckpointError (exit 2) before anything loads

    run_sft_from_config(cfg)


@config_main(CONFIG_DIR, "retool_tiny_sft", SFTConfig)  # a config Hydra or the SFT schema refuses: exit 2
def main(cfg: DictConfig) -> None:
    run_entry(cfg, validate_sft_config, run_sft, SFTConfig)


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
