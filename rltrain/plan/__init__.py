"""rltrain.plan: before launch, the peak memory of every GPU by phase and part and the seconds per step by phase
of a config, from its shapes and the rates measured on H100/H200 (calibration.py), and the cheapest keys to change
when a GPU will not fit. Imports no GPU library and starts nothing: `python -m rltrain.plan --config-name NAME`.

    from rltrain.plan import check
    plan = check(cfg, gpu_memory_gib=80)   # raises PlanError (a UserError: exit 2) when a GPU will not fit

docs/plan.md: the model, the constants and their sources; docs/benchmarks/planner.md: predicted vs measured.
"""

from rltrain.plan.planner import Plan, PlanError, Suggestion
from rltrain.plan.suggest import check, make_plan

__all__ = ["Plan", "PlanError", "Suggestion", "check", "make_plan"]
