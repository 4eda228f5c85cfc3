"""Rollout: generation engines (hf, vllm), sampling params, the multi-turn tool loop.
Importing this package imports no engine backend; engines are built by registry key via build_rollout_engine.
"""

from rltrain.rollout.base import (
    ENGINES,
    Engine,
    RolloutOutput,
    RolloutResponse,
    SamplingParams,
    build_rollout_engine,
    engine_class,
)
from rltrain.rollout.multiturn import TOOL_PATTERNS, MultiTurnRollout, SandboxToolExecutor, ToolExecutor

__all__ = [
    "ENGINES",
    "Engine",
    "MultiTurnRollout",
    "RolloutOutput",
    "RolloutResponse",
    "SamplingParams",
    "SandboxToolExecutor",
    "TOOL_PATTERNS",
    "ToolExecutor",
    "build_rollout_engine",
    "engine_class",
]
