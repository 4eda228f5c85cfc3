"""Sandbox for model-written code: a separate limited process per call, and a bounded pool of them.
Must not import the rest of rltrain (the rollout loop calls in; nothing here calls out)."""

from rltrain.sandbox.runner import STATUSES, SandboxPool, SandboxResult, kill_sandbox_processes, run_code

__all__ = ["STATUSES", "SandboxPool", "SandboxResult", "kill_sandbox_processes", "run_code"]
