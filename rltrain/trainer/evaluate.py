"""Held-out evaluation of a model and of finished runs: greedy accuracy on the val split, learning curves, and
whether two run variants differ by more than seed noise. Must not train or write files; the learning recipe's
driver (tools/learn_gpu.py) calls it.

`evaluate` samples the RL config's val prompts with the hf engine (the reference engine; the multi-turn tool
loop and the real sandbox when the config enables it) and scores them with `rewards.scoring.score_batch`, the
scorer the trainer's validation uses, so the two report the same number for the same model.
"""

from __future__ import annotations

import time

# metrics.jsonl keys kept as per-step curves of a run
CURVE_KEYS = ("val/accuracy", "critic/score/mean", "response_length/mean", "actor/entropy", "actor/grad_norm",
              "val/reward/correct_tool_call/mean", "val/reward/tool_call/mean", "reward/correct_tool_call/mean",
              "reward/tool_call/mean", "rollout/logprob_diff_max")
TRAIN_S_KEY = "val/accuracy@train_s"  # curve(): held-out accuracy by training seconds instead of by step


def evaluate(cfg, model=None, *, batch: int, tool_workers: int) -> dict:
    """Held-out accuracy of one model: the RL config's val files, prompts, rollout limits and reward, greedy.

    cfg: a typed RLConfig.
    model: a transformers model (e.g. a random init) or None to load model.path (a model directory, or a LoRA run's
    PEFT adapter directory: its base with the adapters merged).
    Returns accuracy (share of scores > 0), n, the reward's extra metrics by bare name (e.g. correct_tool_call),
    mean response tokens, seconds and the first response as an example."""
    import dataclasses

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rltrain.models.hf import is_peft_adapter, load_merged_adapter
    from rltrain.rewards.scoring import response_texts, score_batch
    from rltrain.trainer.setup import build_datasets
    from rltrain.workers.hybrid import resolve_device
    from rltrain.workers.rollout import RolloutRole

    t0 = time.time()
    r, seed = cfg.rollout, cfg.trainer.seed
    device = resolve_device(cfg.trainer.device)
    dtype = torch.float32 if device == "cpu" else getattr(torch, cfg.model.dtype)
    tokenizer, _, val_ds, _, reward = build_datasets(cfg)
    if model is None and is_peft_adapter(cfg.model.path):  # a LoRA run's export: its base, the adapters merged
        model = load_merged_adapter(cfg.model.path, dtype=dtype)
    elif model is None:
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype,
                                                     trust_remote_code=cfg.model.trust_remote_code)
    rollout_cfg = dataclasses.replace(r, max_batch_size=batch,
                                      multi_turn=dataclasses.replace(r.multi_turn, tool_max_workers=tool_workers))
    role = RolloutRole(engine="hf", model=model, tokenizer=tokenizer, rollout_cfg=rollout_cfg, device=device,
                       dtype=dtype, seed=seed, sandbox_cfg=cfg.sandbox)
    items = [val_ds[i] for i in range(len(val_ds))]
    b, _ = role.generate(items, group_offset=0, validate=True, seed=seed)
    # max_workers=0: the recipe's rewards are cheap pure functions, scored in this process
    scores, metrics = score_batch(b, reward, tokenizer=tokenizer, multi_turn=r.multi_turn.enable,
                                  timeout_s=cfg.reward.timeout_s, max_workers=0)
    if role.multi_turn is not None:
        role.multi_turn.tool_executor.close()
    out = {"accuracy": float(np.mean([s > 0 for s in scores.tolist()])), "n": len(scores),
           "response_tokens_mean": float(b.response_mask.sum(-1).float().mean()),
           "seconds": round(time.time() - t0, 1), "example": response_texts(b.select([0]), tokenizer)[0][:300]}
    out.update({k.split("/")[1]: v for k, v in metrics.items() if k.endswith("/mean")})
    del role, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def fmt_eval(e: dict) -> str:
    s = f"accuracy {e['accuracy']:.3f} (n={e['n']})"
    if "correct_tool_call" in e:
        s += f", correct tool calls {e['correct_tool_call']:.3f}, tool calls {e['tool_call']:.3f}"
    return s


def curve(rows: list[dict]) -> dict:
    """{key: [[step, value], ...]} of CURVE_KEYS from metrics.jsonl rows, and held-out accuracy by training seconds
    (TRAIN_S_KEY: [[seconds, accuracy], ...], seconds = the sum of timing_s/step up to that step: wall clock without
    start-up and validation)."""
    out = {k: [[r["step"], r[k]] for r in rows if isinstance(r.get(k), (int, float))] for k in CURVE_KEYS
           if any(k in r for r in rows)}
    train_s, by_s = 0.0, []
    for r in rows:
        train_s += r.get("timing_s/step", 0.0)
        if isinstance(r.get("val/accuracy"), (int, float)):
            by_s.append([round(train_s, 2), r["val/accuracy"]])
    if by_s:
        out[TRAIN_S_KEY] = by_s
    return out


def phase_timing(rows: list[dict], *, samples: int) -> dict:
    """Mean seconds per phase over steps 2.. (step 1 compiles kernels) and tokens/s per phase. samples: the run's
    samples per step (data.train_batch_size * rollout.n)."""
    steady = [r for r in rows if r.get("step", 0) >= 2 and "timing_s/step" in r] or [r for r in rows if "timing_s/step" in r]
    if not steady:
        return {}
    mean = lambda k: sum(r.get(k, 0.0) for r in steady) / len(steady)  # noqa: E731
    total_tokens = mean("perf/total_num_tokens")
    response_tokens = mean("response_length/mean") * samples
    out = {f"{k.split('/')[1]}_s": mean(k) for k in steady[-1] if k.startswith("timing_s/")}
    out.update({"tokens_per_step": total_tokens, "response_tokens_per_step": response_tokens,
                "tokens_per_s_end_to_end": total_tokens / max(out["step_s"], 1e-9),
                "gen_response_tokens_per_s": response_tokens / max(out.get("gen_s", 0), 1e-9),
                "old_log_prob_tokens_per_s": total_tokens / max(out.get("old_log_prob_s", 0), 1e-9),
                "update_actor_tokens_per_s": total_tokens / max(out.get("update_actor_s", 0), 1e-9)})
    return out


# a GRPO run's variant: fused head, materialized logits, fused head + LoRA, fused head (torch backend) with
# rollout.true_on_policy
RUN_KINDS = ("fused", "unfused", "lora", "top")


def run_key(name: str) -> tuple[str, int, str | None]:
    """(kind: one of RUN_KINDS, seed, rollout engine or None) of a run named `fused_seed1`, `lora_seed2_vllm`, ..."""
    kind, seed, *engine = name.split("_")
    return kind, int(seed.removeprefix("seed")), engine[0] if engine else None


def _accuracy_gap(runs: dict, a: str, b: str) -> float:
    """Mean |held-out accuracy difference| of two runs over their shared eval steps > 0."""
    ca, cb = (dict((s, v) for s, v in runs[n]["curve"].get("val/accuracy", [])) for n in (a, b))
    steps = sorted(set(ca) & set(cb) - {0})
    return sum(abs(ca[s] - cb[s]) for s in steps) / max(len(steps), 1)


def _paired_gap(runs: dict, ref: list[str], new: list[str], seed_of: dict, two_se: float) -> dict | None:
    """Runs of a reference variant against runs of a new one, paired by seed: the largest same-seed gap against the
    gap between two seeds of the reference (else of the new variant). None without a pair and two seeds."""
    ref, new = sorted(ref, key=seed_of.get), sorted(new, key=seed_of.get)
    pairs = [(r, n) for r in ref for n in new if seed_of[r] == seed_of[n]]
    seeds = [tuple(side[:2]) for side in (ref, new) if len(side) >= 2]
    if not pairs or not seeds:
        return None
    gaps = {f"{a} vs {b}": _accuracy_gap(runs, a, b) for a, b in pairs}  # every seed run with both
    (a, b), (s1, s2) = max(pairs, key=lambda p: gaps[f"{p[0]} vs {p[1]}"]), seeds[0]
    g, g_s = gaps[f"{a} vs {b}"], _accuracy_gap(runs, s1, s2)
    return {"reference": a, "other": b, "seed_a": s1, "seed_b": s2, "gap": g, "gaps_by_seed": gaps,
            "gap_seeds": g_s, "two_se": two_se, "within_noise": g <= g_s + two_se}


def compare_runs(runs: dict, n_val: int, default_engine: str = "hf") -> dict:
    """Fused vs materialized logits against seed noise, on the held-out accuracy curves (same eval steps):
    gap(a, b) = mean over eval steps of |acc_a - acc_b|. Within noise when gap(fused s, unfused s) <=
    gap(fused s, fused s') + 2 SE, SE = sqrt(2 * 0.25 / n_val) (the largest standard error of a difference
    of two accuracies on n_val prompts). Runs of one engine are compared with each other; with runs of two
    engines the same test compares the engines ("engines": hf seed s vs vllm seed s against two seeds of the
    reference engine, hf, or of the other engine where hf has one seed), and with LoRA runs ("lora") full fine-tuning
    (fused) seed s against LoRA seed s, same engine, against two seeds of full fine-tuning, else of LoRA, with each
    run's mean seconds per step. Run names as `run_key` reads them."""
    done = [n for n in runs if "after" in runs[n]]  # finished runs only: a stopped run's curve is partial
    key = {}
    for n in done:
        kind, seed, engine = run_key(n)
        key[n] = (kind, seed, engine or default_engine)
    seed_of = {n: k[1] for n, k in key.items()}
    two_se = 2 * (2 * 0.25 / n_val) ** 0.5
    out: dict = {}
    for engine in sorted({k[2] for k in key.values()}):
        fused = sorted(n for n in done if key[n][0] == "fused" and key[n][2] == engine)
        unfused = sorted(n for n in done if key[n][0] == "unfused" and key[n][2] == engine)
        if len(fused) < 2 or not unfused:
            continue
        u = unfused[0]
        same_seed = next((f for f in fused if key[f][1] == key[u][1]), fused[0])
        other = next(f for f in fused if f != same_seed)
        g_fu, g_ss = _accuracy_gap(runs, same_seed, u), _accuracy_gap(runs, same_seed, other)
        out.update({"fused": same_seed, "unfused": u, "other_seed": other, "gap_fused_unfused": g_fu,
                    "gap_seeds": g_ss, "two_se": two_se, "within_noise": g_fu <= g_ss + two_se,
                    "definition": "mean |val accuracy gap| over shared eval steps > 0; within noise iff "
                                  "gap(fused, unfused) <= gap(fused seed a, fused seed b) + 2*sqrt(0.5/n_val)"})
        break
    fused_done = [n for n in done if key[n][0] == "fused"]
    engines = sorted({key[n][2] for n in fused_done})
    if len(engines) == 2:
        ref, new = ("hf", "vllm") if engines == ["hf", "vllm"] else tuple(engines)
        p = _paired_gap(runs, [n for n in fused_done if key[n][2] == ref], [n for n in fused_done if key[n][2] == new],
                        seed_of, two_se)
        if p:
            out["engines"] = {"reference": p["reference"], "engine": p["other"], "seed_a": p["seed_a"],
                              "seed_b": p["seed_b"], "gap_engines": p["gap"], "gaps_by_seed": p["gaps_by_seed"],
                              "gap_seeds": p["gap_seeds"], "two_se": two_se, "within_noise": p["within_noise"],
                              "definition": "within noise iff the largest gap(ref engine seed s, engine seed s) "
                                            "<= gap(seed a, seed b of one engine) + 2*sqrt(0.5/n_val)"}
    for kind, gap_key in (("lora", "gap_lora"), ("top", "gap_true_on_policy")):
        for engine in sorted({k[2] for k in key.values()}):
            full = [n for n in fused_done if key[n][2] == engine]
            variant = [n for n in done if key[n][0] == kind and key[n][2] == engine]
            p = _paired_gap(runs, full, variant, seed_of, two_se)
            if p:
                step_s = {n: (runs[n].get("timing") or {}).get("step_s") for n in full + variant}
                out[kind] = {"full": p["reference"], kind: p["other"], "seed_a": p["seed_a"], "seed_b": p["seed_b"],
                             gap_key: p["gap"], "gaps_by_seed": p["gaps_by_seed"], "gap_seeds": p["gap_seeds"],
                             "two_se": two_se, "within_noise": p["within_noise"], "step_s": step_s,
                             "definition": f"within noise iff the largest gap(fused seed s, {kind} seed s) <= "
                                           "gap(seed a, seed b of one of them) + 2*sqrt(0.5/n_val)"}
                break
    return out
