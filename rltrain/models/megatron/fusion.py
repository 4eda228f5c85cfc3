"""How a built Megatron model's elementwise work runs (`elementwise_fusion`, applied once after build): none,
megatron-core's own fused kernels, or torch.compile of each layer. Nothing else of the engine here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rltrain.compat.megatron import quiet_tp_group_default
from rltrain.config.schema import ELEMENTWISE_FUSIONS

# torch.compile backend of elementwise_fusion="compile" (tests on CPU use "aot_eager": inductor's CPU codegen
# takes ~30 s for a tiny layer)
COMPILE_BACKEND = "inductor"


def _no_fusion(model) -> None:
    return None


def _mcore_fusion(model) -> None:
    """megatron-core's own fused elementwise kernels that need no Transformer Engine: SwiGLU (saves only the
    fc1 output, recomputes silu in backward) and bias-dropout-add, both through its `jit_fuser`
    (torch.compile). Read from the shared TransformerConfig at forward time."""
    model.config.bias_activation_fusion = True
    model.config.bias_dropout_fusion = True


def _compile_fusion(model) -> None:
    """torch.compile each transformer layer (norms, RoPE, SwiGLU, residual adds and casts fused by inductor
    around the cuBLAS GEMMs and the SDPA kernel). One graph per layer type, shared by all layers. megatron's
    fusions too, for the parts that leave the graph (the MLP under selective recompute: its checkpoint's RNG
    calls are a graph break)."""
    _mcore_fusion(model)
    quiet_tp_group_default()  # megatron's RowParallelLinear warns on every call: a graph break per layer
    for layer in model.decoder.layers:
        layer.compile(backend=COMPILE_BACKEND)


# elementwise_fusion -> function(model) applied once after build; its names are config/schema.py's ELEMENTWISE_FUSIONS
FUSIONS: dict[str, Callable[[Any], None]] = {"none": _no_fusion, "mcore": _mcore_fusion, "compile": _compile_fusion}
assert tuple(FUSIONS) == ELEMENTWISE_FUSIONS, (tuple(FUSIONS), ELEMENTWISE_FUSIONS)
