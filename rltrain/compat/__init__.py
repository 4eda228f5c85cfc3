"""Version and platform shims for the libraries rltrain runs on: megatron-core, vLLM, Ray, torch/Triton.
Each module holds what one library needs patched or probed; it imports nothing else from rltrain, so any room
(ops/ included) may import it.

    compat.megatron   megatron-core on CPU (RNG tracker, RoPE, pipeline schedule) and its per-call TP warning
    compat.vllm       the supported vLLM range and the vLLM internals the engine reaches (shutdown, EOS, NCCL)
    compat.ray        Ray on loopback only (its cluster switch, read once at import), its auth token kept private
    compat.torch      torch/Triton features probed at run time (fp32-output GEMMs, TMA tensor descriptors), and
                      torch.distributed's rendezvous store listening on its meeting address only
"""
