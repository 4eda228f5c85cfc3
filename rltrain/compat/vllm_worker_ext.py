"""vLLM's worker extension for rollout.true_on_policy (vllm.LLM(worker_extension_cls=WORKER_EXTENSION)): vLLM
imports this module in every worker process it starts, engines in processes of their own included (an engine pool,
rollout.engines_per_gpu > 1), and importing it routes that process's residual norms as vllm_kernels.enable does in
the trainer's (compat/vllm_kernels.route_residual_norms). Import side effect by design: the extension's import is
vLLM's one hook into its worker processes that needs no installed entry point. Imports vLLM: only vLLM loads it.
"""

from __future__ import annotations

from vllm.model_executor.layers import layernorm

from rltrain.compat.vllm_kernels import route_residual_norms

route_residual_norms(layernorm)


class RoutedNormsWorker:
    """Added to the bases of vLLM's worker class: one call, through LLM.collective_rpc."""

    def rltrain_norms_routed(self) -> bool:
        """Whether this worker process's residual norms go through the add and the row norm."""
        return bool(getattr(layernorm.rms_norm_batch_invariant, "_rltrain_routed", False))


