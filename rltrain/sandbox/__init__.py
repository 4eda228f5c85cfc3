"""Sandbox for model-written code: a separate limited process per call, and a bounded pool of them.
Must not import the rest of rltrain (the rollout loop calls in; nothing here calls out)."""

from rltrain.sandbox.runner import (
    ALLOW_UNISOLATED_HINT,
    STATUSES,
    SandboxPool,
    SandboxResult,
    kill_sandbox_processes,
    probe_isolation,
    run_code,
)

__all__ = ["ALLOW_UNISOLATED_HINT", "STATUSES", "SandboxPool", "SandboxResult", "kill_sandbox_processes",
           "probe_isolation", "run_code"]
