"""The rules of on-policy distillation's keys (teacher.*, algorithm.distill_coef, docs/distill.md): which settings
cannot work, each naming the key and the fix. Config only: validate.py calls it with the rest (and passes its rule of
a model's keys for the teacher's; the teacher's placement: workers/placement.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from rltrain.config.schema import TeacherConfig


def distill_errors(cfg, model_rule: Callable[[list, Any, str], None]) -> list[str]:
    """Every problem of the distillation keys of the typed RLConfig `cfg`; model_rule(errors, the
    teacher's ModelConfig, "teacher") appends those of its model keys."""
    te, al = cfg.teacher, cfg.algorithm
    if not TeacherConfig.enabled(te):
        if al.adv_estimator == "distill":
            return ["algorithm.adv_estimator=distill (pure on-policy distillation) needs a teacher: set teacher.path "
                    "(an HF directory or an rltrain checkpoint of a model with the student's vocabulary)"]
        return []
    e = []
    if te.path is not None and te.builtin is not None:
        e.append("teacher.path and teacher.builtin are both set; the teacher is one model: set one of them")
    for key in ("n_gpus_per_node", "tensor_parallel_size", "pipeline_parallel_size",
                "log_prob_max_tokens_per_micro_batch"):
        value = getattr(te, key)
        if (value is not None or key == "n_gpus_per_node") and not (value is not None and value > 0):
            e.append(f"teacher.{key}={value} is impossible; it must be > 0" + ("" if key == "n_gpus_per_node" else
                                                                                " (or null: the actor's)"))
    if not (math.isfinite(al.distill_coef) and al.distill_coef > 0):
        e.append(f"algorithm.distill_coef={al.distill_coef}: with a teacher set it must be a finite number > 0 (its "
                 "weight on the reverse-KL advantage); to train without distillation leave teacher.path null")
    model_rule(e, te, "teacher")
    if not cfg.actor.recompute_old_logprobs:
        e.append("a teacher (on-policy distillation) needs the old log-probs before the update (its advantage is "
                 "log pi_teacher - log pi_old): set actor.recompute_old_logprobs=true")
    return e
