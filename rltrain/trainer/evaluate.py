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


def evaluate(cfg, model=None, *, batch: int, tool_workers: int) -> dict:
    """Held-out accuracy of one model: the RL config's val files, prompts, rollout limits and reward, greedy.

    cfg: a typed RLConfig.
    model: a transformers model (e.g. a random init) or None to load model.path.
    Returns accuracy (share of scores > 0), n, the reward's extra metrics by bare name (e.g. correct_tool_call),
    mean response tokens, seconds and the first response as an example."""
    import dataclasses

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rltrain.rewards.scoring import response_texts, score_batch
    from rltrain.trainer.setup import build_datasets
    from rltrain.workers.hybrid import resolve_device
    from rltrain.workers.rollout import RolloutRole

    t0 = time.time()
    r, seed = cfg.rollout, cfg.trainer.seed
    device = resolve_device(cfg.trainer.device)
    dtype = torch.float32 if device == "cpu" else getattr(torch, cfg.model.dtype)
    tokenizer, _, val_ds, _, reward = build_datasets(cfg)
    if model is None:
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
    """{key: [[step, value], ...]} of CURVE_KEYS from metrics.jsonl rows."""
    return {k: [[r["step"], r[k]] for r in rows if isinstance(r.get(k), (int, float))] for k in CURVE_KEYS
            if any(k in r for r in rows)}


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


def run_key(name: str) -> tuple[bool, int, str | None]:
    """(fused head, seed, rollout engine or None) of a run named `fused_seed1`, `unfused_seed2_vllm`, ..."""
    head, seed, *engine = name.split("_")
    return head == "fused", int(seed.removeprefix("seed")), engine[0] if engine else None


def _accuracy_gap(runs: dict, a: str, b: str) -> float:
    """Mean |held-out accuracy difference| of two runs over their shared eval steps > 0."""
    ca, cb = (dict((s, v) for s, v in runs[n]["curve"].get("val/accuracy", [])) for n in (a, b))
    steps = sorted(set(ca) & set(cb) - {0})
    return sum(abs(ca[s] - cb[s]) for s in steps) / max(len(steps), 1)


def compare_runs(runs: dict, n_val: int, default_engine: str = "hf") -> dict:
    """Fused vs materialized logits against seed noise, on the held-out accuracy curves (same eval steps):
    gap(a, b) = mean over eval steps of |acc_a - acc_b|. Within noise when gap(fused s, unfused s) <=
    gap(fused s, fused s') + 2 SE, SE = sqrt(2 * 0.25 / n_val) (the largest standard error of a difference
    of two accuracies on n_val prompts). Runs of one engine are compared with each other; with runs of two
    engines the same test compares the engines ("engines": hf seed s vs vllm seed s against two seeds of the
    reference engine, hf, or of the other engine where hf has one seed). Run names as `run_key` reads them."""
    done = [n for n in runs if "after" in runs[n]]  # finished runs only: a stopped run's curve is partial
    key = {}
    for n in done:
        fused, seed, engine = run_key(n)
        key[n] = (fused, seed, engine or default_engine)
    two_se = 2 * (2 * 0.25 / n_val) ** 0.5
    out: dict = {}
    for engine in sorted({k[2] for k in key.values()}):
        fused = sorted(n for n in done if key[n][0] and key[n][2] == engine)
        unfused = sorted(n for n in done if not key[n][0] and key[n][2] == engine)
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
    fused_done = [n for n in done if key[n][0]]
    engines = sorted({key[n][2] for n in fused_done})
    if len(engines) == 2:
        ref, new = ("hf", "vllm") if engines == ["hf", "vllm"] else tuple(engines)
        by_engine = {eng: sorted((n for n in fused_done if key[n][2] == eng), key=lambda n: key[n][1])
                     for eng in (ref, new)}
        pairs = [(r, n) for r in by_engine[ref] for n in by_engine[new] if key[r][1] == key[n][1]]
        # noise: two seeds of the reference engine, else of the other engine
        seeds = [tuple(by_engine[eng][:2]) for eng in (ref, new) if len(by_engine[eng]) >= 2]
        if pairs and seeds:
            gaps = {f"{a} vs {b}": _accuracy_gap(runs, a, b) for a, b in pairs}  # every seed run with both
            (a, b), (s1, s2) = max(pairs, key=lambda p: gaps[f"{p[0]} vs {p[1]}"]), seeds[0]
            g_e, g_s = gaps[f"{a} vs {b}"], _accuracy_gap(runs, s1, s2)
            out["engines"] = {"reference": a, "engine": b, "seed_a": s1, "seed_b": s2, "gap_engines": g_e,
                              "gaps_by_seed": gaps, "gap_seeds": g_s, "two_se": two_se,
                              "within_noise": g_e <= g_s + two_se,
                              "definition": "within noise iff the largest gap(ref engine seed s, engine seed s) "
                                            "<= gap(seed a, seed b of one engine) + 2*sqrt(0.5/n_val)"}
    return out
