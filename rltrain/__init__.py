"""rltrain: PPO/GRPO RL post-training for LLMs.

A Megatron-core actor whose loss computes masked-response log-probs and entropy with a fused LM head
(the [tokens, vocab] logits are never materialized), orchestrated by Ray and configured by Hydra.
"""

__version__ = "0.1.0"
