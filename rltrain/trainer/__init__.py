"""The driver-side loops: PPO/GRPO (`ppo.py`) and SFT (`sft.py`).

The trainer composes workers; it never touches model internals, kernels or Ray placement directly.
"""
