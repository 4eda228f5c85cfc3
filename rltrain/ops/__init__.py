"""Loss-path numerics: per-token log-probs and entropy of the LM head, fused (never materializing
[T, V] logits) or from given logits, vocab-parallel. Pure functions on tensors: nothing here imports the
rest of rltrain or reads a config.
"""

from rltrain.ops.chunking import pick_chunk_size
from rltrain.ops.logprob import logprobs_from_hidden, logprobs_from_logits

__all__ = ["logprobs_from_hidden", "logprobs_from_logits", "pick_chunk_size"]
