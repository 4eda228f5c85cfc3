"""rollout.true_on_policy side by side (issue 60), and its per-token check.

Default: the same run with the key off and on, each `python -m rltrain.main` in a process of its own, one after the
other; per run the mean time of each phase of a step (generation, the actor's log-prob forward, the update, the
weight push) over the steps after the first, the log-prob difference between the rollout engine and the actor (max
and share of tokens that differ, every step) and the held-out accuracy by step. Writes bench_true_on_policy.json and
.md to --out.

  python tools/bench_true_on_policy.py --out /tmp/top --steps 12                   # grpo_tiny on CPU, hf engine
  python tools/bench_true_on_policy.py --out /tmp/top --steps 150 --set trainer.test_freq=25   # learning curves
  PYTHONPATH=/tmp/site:$PWD python tools/bench_true_on_policy.py --out $OUT --gpu-06b --steps 50   # one H200, vLLM
  ... --gpu-06b --steps 10 --rounds 2      # off, on, on, off: the cost with the host's drift cancelled

--gpu-06b: the Qwen3-0.6B-shaped random model of tools/gpu_smoke.py's GRPO section (harness.cases.GRPO_06B_OVERRIDES)
with the vLLM engine colocated, the head on the Triton backend in both runs (with the key on, vLLM's kernels give
the log-prob's value and the Triton head its entropy and gradient).

--check: one GPU, vLLM colocated in this process (batch-invariant mode), the Megatron actor on the same weights
through the worker the trainer uses. Samples a batch, then compares per sampled token
  A  vLLM's decode log-probs (what the rollout reports),
  B  vLLM's prefill log-probs of the same full sequences (prompt_logprobs),
  C  the actor's forward (what the trainer recomputes),
and writes true_on_policy_check.json to --out: max |difference| and the share of tokens that differ for A-C (the
goal: exactly 0), B-C and A-B, the generation and actor-forward seconds, per sequence where A and C first part, per
decoder layer the largest difference of the residual stream between vLLM's prefill and the actor on one sequence,
and the head's stages on that sequence (final norm, logits, log-softmax of each side's logits against what each side
reports); and the partial rollouts' path (each sequence in chunks of a quarter of the response, every chunk re-read
as a fresh request among others) against the actor. Exit 0 when A == C and chunks == C on every token. B is compared
at temperature 1 only (vLLM's prompt log-probs are of the raw logits). Prompts are 4-64 tokens: --max-tokens above
64 makes sequences read more than one 128-key attention tile. With --cpu: a dry run of the flow with the hf engine.

  PYTHONPATH=/tmp/site:$PWD python tools/bench_true_on_policy.py --check --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import device_name, md_table, report_header, run_trainer, write_report
from harness import results as tables
from harness.cases import GRPO_06B_OVERRIDES
from harness.runs import learning_curve

PHASES = ("timing_s/step", "timing_s/gen", "timing_s/gen_engine", "timing_s/old_log_prob", "timing_s/update_actor",
          "timing_s/update_weights")
CPU = ["trainer.use_ray=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.plots=false",
       "trainer.save_freq=-1"]
GPU_06B = [*GRPO_06B_OVERRIDES, "rollout=vllm", "trainer.use_ray=false", "trainer.save_freq=-1"]
# the key on, on either device (the head's backend as the default run's: with vLLM its kernels give the value, the
# fused head the gradient)
ON = ["rollout.true_on_policy=true"]


def profiled_steps(overrides: list[str]) -> set[int]:
    """The steps a run traces (trainer.profile_steps=[...] among its overrides, the last one given)."""
    lists = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.profile_steps=")]
    return {int(x) for x in lists[-1].strip("[] ").split(",") if x.strip()} if lists else set()


def summary_of_runs(runs: list[list[dict]], profiled: set[int] = frozenset()) -> dict:
    """One variant's runs (several with --rounds): phase means over each run's steps after the first (it compiles and
    allocates) that were not traced (the profiler's own cost would count), pooled; every step's mismatch; and each
    run's mean step time (the host's drift between runs shows there)."""
    per_run = [[r for r in rows if "timing_s/step" in r] for rows in runs]
    steps = [r for run in per_run for r in run]
    steadies = [[r for r in run[1:] if r.get("step") not in profiled] or run for run in per_run]
    steady = [r for run in steadies for r in run]
    mean = {k: sum(r.get(k, 0.0) for r in steady) / max(len(steady), 1) for k in PHASES}
    diff = [r.get("rollout/logprob_diff_max") for r in steps]
    rows = runs[-1] if runs else []
    return {"steps": len(steps), "mean": mean, "logprob_diff_max": diff,
            "step_s_by_run": [round(sum(r["timing_s/step"] for r in run) / max(len(run), 1), 4) for run in steadies],
            "nonzero_frac": [r.get("rollout/logprob_diff_nonzero_frac") for r in steps],
            "all_zero": bool(steps) and all(d == 0.0 for d in diff),
            "score_last10": sum(r.get("critic/score/mean", 0.0) for r in steps[-10:]) / max(len(steps[-10:]), 1),
            "val_accuracy": learning_curve(rows)["by_step"]}


def run_order(variants: list[str], rounds: int) -> list[str]:
    """The variants' runs over `rounds` rounds, every other round reversed (A B, B A, A B, ...)."""
    if rounds < 1:
        raise SystemExit("bench_true_on_policy: --rounds must be >= 1")
    return [v for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def table_row(name: str, run: dict, report: dict, args) -> dict:
    """The run's row of the rollout table: phase means, the worst difference and the mean share that differs."""
    diffs = [d for d in run["logprob_diff_max"] if d is not None]
    fracs = [f for f in run["nonzero_frac"] if f is not None]
    metrics = {**{k.split("/")[-1] + "_s": round(v, 4) for k, v in run["mean"].items()}, "steps": run["steps"],
               "logprob_diff_max": max(diffs, default=None),
               "nonzero_frac_mean": sum(fracs) / len(fracs) if fracs else None}
    shape = "qwen3-0.6b-random" if args.gpu_06b else args.config
    device = tables.device_kind(device_name()) if args.gpu_06b else "cpu"  # after the run: CUDA stays out of it
    return tables.row("bench_true_on_policy", shape, device, f"true_on_policy_{name}", metrics, date=report["date"],
                      config=list(run.get("config", [])))


def check_row(result: dict, args, date: str) -> dict:
    """--check's row of the rollout table: the largest difference and the share that differs, decode against the
    actor and the chunked path against the actor; the variant names the check's settings (--set, --max-tokens)."""
    dec, chk = result["decode_vs_actor"], result["chunked_vs_actor"]
    metrics = {"decode_vs_actor_max": dec["max"], "decode_vs_actor_nonzero_frac": dec["nonzero_frac"],
               "chunked_vs_actor_max": chk["max"], "tokens": dec["tokens"]}
    shape, device = ("grpo_tiny", "cpu") if args.cpu else ("qwen3-0.6b-random", tables.device_kind(device_name()))
    builtin = [o.split("=", 1)[1] for o in args.set if o.startswith("model.builtin=")]
    shape = builtin[-1] if builtin else shape  # the model --set chose (its slice: the variant names the overrides)
    variant = ", ".join(["check", *args.set, f"{args.max_tokens} response tokens"])
    return tables.row("bench_true_on_policy", shape, device, variant, metrics, date=date,
                      config=list(result["config"]))


def markdown(report: dict) -> str:
    runs = report["runs"]
    rows = []
    for k in PHASES:
        off, on = runs["off"]["mean"][k], runs["on"]["mean"][k]
        rows.append([k, f"{off:.4f}", f"{on:.4f}", f"{on / off:.2f}x" if off > 0 else "-"])
    out = [f"# rollout.true_on_policy: cost and mismatch ({report['date']}, {report['device']})", "",
           f"`{report['command']}`", "", "Mean seconds per step after the first (traced steps left out):", "",
           md_table(["phase", "off", "on", "on / off"], rows, ["---", "---:", "---:", "---:"]), ""]
    for name, r in runs.items():
        diffs = [d for d in r["logprob_diff_max"] if d is not None]
        fracs = [f for f in r["nonzero_frac"] if f is not None]
        out.append(f"- {name}: {r['steps']} steps; rollout/logprob_diff_max max {max(diffs, default=float('nan')):.3g}"
                   f" (exactly 0 every step: {r['all_zero']}); share of tokens that differ, mean "
                   f"{sum(fracs) / max(len(fracs), 1):.3g}; critic/score/mean over the last 10 steps "
                   f"{r['score_last10']:.3f}; val/accuracy by step {r['val_accuracy']}")
    if len(report.get("order", [])) > 2:
        by_run = {name: iter(r.get("step_s_by_run", [])) for name, r in runs.items()}
        out.append("- runs in order (mean step s): " + ", ".join(
            f"{tag} {next(by_run[tag.rsplit('_', 1)[0]], float('nan')):.3f}" for tag in report["order"]))
    return "\n".join(out) + "\n"


def _prefill_logprobs(llm, sequences: list[list[int]]) -> list[list[float]]:
    """vLLM's prompt log-probs of each full sequence (entry t: log p(x_t | x_<t); entry 0 is 0)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
    got = []
    for seq, out in zip(sequences, outs):
        lps = out.prompt_logprobs
        row = [0.0]
        for t in range(1, len(seq)):
            if hasattr(lps, "start_indices"):  # FlatLogprobs
                lo, hi = lps.start_indices[t], lps.end_indices[t]
                j = lo + lps.token_ids[lo:hi].index(seq[t])
                row.append(float(lps.logprobs[j]))
            else:
                row.append(float(lps[t][seq[t]].logprob))
        got.append(row)
    return got


def _layer_diffs(w, seq: list[int]) -> list[float]:
    """Per decoder layer, max |actor - vLLM| of the residual stream after it, over one sequence's positions: vLLM's
    prefill (its layer returns the MLP output and the residual, which the next fused norm adds in the model dtype)
    against the Megatron layer's output. The first nonzero entry is where the two forwards part."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    got: dict = {"vllm": {}, "actor": {}}

    def hook(store, i, vllm_layer):
        def on_forward(mod, args, out):
            hidden = out[0] + out[1] if vllm_layer else out[0][:, 0]
            store[i] = hidden.detach().float().cpu()
        return on_forward

    handles = []

    def attach(model):
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.register_forward_hook(hook(got["vllm"], i, True)))

    llm = w.rollout.engine.llm
    llm.apply_model(attach)
    llm.reset_prefix_cache()
    try:
        llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    eng = w.actor.engine
    handles = [layer.register_forward_hook(hook(got["actor"], i, False))
               for i, layer in enumerate(eng.model.decoder.layers)]
    try:
        ids = torch.tensor([seq])
        eng.forward_logprobs(ids, torch.tensor([len(seq)]), torch.ones_like(ids, dtype=torch.bool))
    finally:
        for h in handles:
            h.remove()
    return [float((got["vllm"][i][:len(seq)] - got["actor"][i][:len(seq)]).abs().max()) for i in sorted(got["actor"])]


def _head_diffs(w, seq: list[int]) -> dict:
    """The head's stages on one sequence, vLLM's prefill (prompt log-probs on) against the actor: the final norm's
    output, the logits, each side's reported log-probs against the Triton log-softmax of its own logits, and the two
    sides' log-softmax against each other. The first stage with a nonzero entry is where the two part."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rltrain.compat import vllm_kernels
    from rltrain.models.megatron.head import lm_head_weight

    got: dict = {"norm": [], "logits": []}

    def keep(name):
        def on_forward(mod, args, out):
            got[name].append((out[0] if isinstance(out, tuple) else out).detach().float().cpu())
        return on_forward

    handles = []

    def attach(model):
        handles.append(model.model.norm.register_forward_hook(keep("norm")))
        handles.append(model.logits_processor.register_forward_hook(keep("logits")))

    llm = w.rollout.engine.llm
    llm.apply_model(attach)
    llm.reset_prefix_cache()
    try:
        reported_b = _prefill_logprobs(llm, [seq])[0]
    finally:
        for h in handles:
            h.remove()
    s = len(seq)
    eng = w.actor.engine
    act: dict = {}
    hook = eng.model.decoder.final_layernorm.register_forward_hook(lambda m, a, o: act.__setitem__("norm", o.detach()))
    try:
        ids = torch.tensor([seq])
        lp_c, _ = eng.forward_logprobs(ids, torch.tensor([s]), torch.ones_like(ids, dtype=torch.bool))
    finally:
        hook.remove()
    dev = act["norm"].device
    hid_a = act["norm"].reshape(-1, act["norm"].shape[-1])[:s]
    hid_v = max(got["norm"], key=len)[:s].to(dev)
    z_v = max(got["logits"], key=len).to(dev)  # the prompt log-probs' logits: rows 0.. of the positions
    rows = min(len(z_v), s - 1)
    z_v = z_v[:rows]
    weight = lm_head_weight(eng.model)[: z_v.shape[1]]
    z_a = vllm_kernels.linear(hid_a[:rows], weight).float()
    labels = torch.tensor(seq[1:rows + 1], device=dev)
    from vllm.model_executor.layers.batch_invariant import log_softmax as triton_log_softmax
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs as v2_token_logprobs

    def at(lp_all):
        return lp_all.gather(-1, labels[:, None]).squeeze(-1)

    def cmp(a, b) -> dict:
        d = (a.float() - b.float()).abs()
        return {"max": float(d.max()) if d.numel() else 0.0, "nonzero": int((d != 0).sum()), "of": int(d.numel())}

    b_rep = torch.tensor(reported_b[1:rows + 1], device=dev)
    c_rep = lp_c[0, 1:rows + 1].to(dev)
    torch_op = at(z_v.log_softmax(dim=-1, dtype=torch.float32))
    torch_op_bf16 = at(z_v.bfloat16().log_softmax(-1, dtype=torch.float32))
    return {"positions": rows, "final_norm": cmp(hid_v, hid_a), "logits": cmp(z_v, z_a),
            "vllm_reported_vs": {"torch_op_fp32": cmp(b_rep, torch_op),
                                 "torch_op_bf16_in": cmp(b_rep, torch_op_bf16),
                                 "triton_log_softmax": cmp(b_rep, at(triton_log_softmax(z_v.contiguous(), -1))),
                                 "v2_compute_token_logprobs": cmp(b_rep, v2_token_logprobs(
                                     z_v.bfloat16().contiguous(), labels[:, None])[:, 0])},
            "actor_reported_vs_torch_op_fp32": cmp(c_rep, at(z_a.log_softmax(dim=-1, dtype=torch.float32))),
            "actor_reported_vs_token_logprobs": cmp(c_rep, vllm_kernels.token_logprobs(hid_a[:rows], weight, labels,
                                                                                        1.0)),
            "reported_vllm_vs_actor": cmp(b_rep, c_rep)}


def _compare(a, b) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return {"tokens": len(diffs), "max": max(diffs, default=0.0),
            "nonzero_frac": sum(d != 0 for d in diffs) / max(len(diffs), 1)}


def _parting(a_rows: list[list[float]], c_rows: list[list[float]], prompt_lens: list[int]) -> list[dict]:
    """Per sequence (the first 24): prompt length, response length, the tokens whose A and C differ and the first."""
    out = []
    for a, c, p in list(zip(a_rows, c_rows, prompt_lens))[:24]:
        bad = [i for i, (x, y) in enumerate(zip(a, c)) if x != y]
        out.append({"prompt": p, "response": len(a), "differ": len(bad), "first": bad[0] if bad else None,
                    "max": max((abs(a[i] - c[i]) for i in bad), default=0.0)})
    return out


def _rows(batch, *per_token) -> tuple[list, list, list]:
    """Per sampled sequence: its prompt + response token ids, (prompt length, response length), and for each [B, S]
    tensor of per_token (the sampler's log-probs, the actor's) its values at the response tokens, as lists."""
    mask = batch.loss_mask.bool()
    seqs, lens, picked = [], [], [[] for _ in per_token]
    for i in range(mask.shape[0]):
        p = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        r = batch.response_ids[i][mask[i]].tolist()
        seqs.append(p + r)
        lens.append((len(p), len(r)))
        for out, t in zip(picked, per_token):
            out.append(t[i][mask[i]].tolist())
    return seqs, lens, picked


def _prefill_rows(llm, seqs: list[list[int]], lens: list[tuple[int, int]]) -> list[list[float]]:
    """vLLM's prefill log-probs of each sequence's response tokens (_rows' sequences and lengths)."""
    return [row[np_:np_ + nr] for row, (np_, nr) in zip(_prefill_logprobs(llm, seqs), lens)]


def _decode_variants(w, llm, vocab: int) -> dict:
    """vLLM's decode against its own prefill under other batch compositions (where the decode arithmetic parts from
    the prefill's, if it does): no seed, twice the prompts, short prompts, one prompt."""
    def prompts(count, lo, hi, seed):
        rng = random.Random(seed)
        return [{"prompt_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(lo, hi))], "ground_truth": None,
                 "data_source": "random"} for _ in range(count)]

    out = {}
    variants = (("no_seed", prompts(32, 4, 65, 0), None), ("64_prompts", prompts(64, 4, 65, 1), 7),
                ("short_prompts", prompts(32, 4, 13, 2), 7), ("one_prompt", prompts(1, 30, 31, 3), 7))
    for name, batch_prompts, seed in variants:
        try:
            batch, _ = w.generate(batch_prompts, 0, False, seed)
            seqs, idx, (a_rows,) = _rows(batch, batch.sampler_logprobs)
            b_rows = _prefill_rows(llm, seqs, idx)
            out[name] = {**_compare([x for r in a_rows for x in r], [x for r in b_rows for x in r]),
                         "by_sequence": _parting(a_rows, b_rows, [p for p, _ in idx])[:6]}
        except Exception as err:  # noqa: BLE001
            out[name] = f"not measured: {type(err).__name__}: {err}"[:300]
    return out


def _chunked_vs_actor(w, prompts: list[dict], seed: int, temperature: float) -> dict:
    """The partial rollouts' path on the engine (rollout/partial.py, weights fixed): each sequence generated in chunks
    of rollout.partial_chunk_tokens new tokens, every chunk a fresh request of prompt + tokens so far, re-read
    among other sequences at other lengths; the chunks' sampler log-probs against the actor's forward."""
    from rltrain.rollout.partial import FixedVersion

    w.rollout.partial = FixedVersion()
    try:
        batch, _ = w.generate(prompts, 0, False, seed)
    finally:
        w.rollout.partial = None
    old, _ = w.compute_old_logprobs(batch, temperature)
    _, idx, (a_rows, c_rows) = _rows(batch, batch.sampler_logprobs, old)
    return {**_compare([x for r in a_rows for x in r], [x for r in c_rows for x in r]),
            "chunk_tokens": int(w.rollout.cfg.partial_chunk_tokens),
            "by_sequence": _parting(a_rows, c_rows, [p for p, _ in idx])[:6]}


def check(args) -> int:
    """--check (module docstring)."""
    import torch

    from rltrain.config import validate_config
    from rltrain.config.entry import compose_config
    from rltrain.workers.group import LocalWorkerGroup
    from rltrain.workers.hybrid import HybridWorker

    base = ["trainer.device=cpu"] if args.cpu else [*GRPO_06B_OVERRIDES, "rollout=vllm"]
    overrides = [*base, "trainer.use_ray=false", "rollout.true_on_policy=true", f"rollout.n={args.n}",
                 f"rollout.max_response_length={args.max_tokens}",
                 f"rollout.partial_chunk_tokens={max(1, args.max_tokens // 4)}", *args.set]
    cfg = compose_config("grpo_tiny", overrides)
    validate_config(cfg)
    group = LocalWorkerGroup(HybridWorker, worker_kwargs={"cfg": cfg, "roles": ["actor", "rollout"]})
    group.setup()
    w = group.workers[0]
    rng = random.Random(0)
    vocab = int(w.hf_config.vocab_size)
    prompts = [{"prompt_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(4, 65))], "ground_truth": None,
                "data_source": "random"} for _ in range(args.prompts)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    batch, _ = w.generate(prompts, 0, False, 1234)
    sync()
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    old, _ = w.compute_old_logprobs(batch, float(cfg.rollout.temperature))
    sync()
    fwd_s = time.perf_counter() - t0
    sequences, b_idx, (a_rows, c_rows) = _rows(batch, batch.sampler_logprobs, old)
    a = [x for row in a_rows for x in row]
    c = [x for row in c_rows for x in row]
    result = {"config": overrides, "generate_s": gen_s, "actor_forward_s": fwd_s, "decode_vs_actor": _compare(a, c),
              "decode_vs_actor_by_sequence": _parting(a_rows, c_rows, [p for p, _ in b_idx])}
    result["chunked_vs_actor"] = _chunked_vs_actor(w, prompts, 4321, float(cfg.rollout.temperature))
    llm = getattr(w.rollout.engine, "llm", None)
    if llm is not None and float(cfg.rollout.temperature) != 1.0:
        result["prefill_vs_actor"] = result["decode_vs_prefill"] = result["decode_vs_prefill_by_batch"] = (
            "not compared: vLLM's prompt log-probs are of the raw logits (temperature 1), the sampler's and the "
            "actor's of logits / temperature")
    elif llm is not None:
        b = [x for row in _prefill_rows(llm, sequences, b_idx) for x in row]
        result.update(prefill_vs_actor=_compare(b, c), decode_vs_prefill=_compare(a, b))
        for name, fn in (("layer_max_abs_diff", _layer_diffs), ("head", _head_diffs)):
            try:  # where the forwards part, if they do (a diagnosis: its failure does not fail the check)
                result[name] = fn(w, sequences[0])
            except Exception as err:  # noqa: BLE001
                result[name] = f"not measured: {type(err).__name__}: {err}"[:500]
        result["decode_vs_prefill_by_batch"] = _decode_variants(w, llm, vocab)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "true_on_policy_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1), flush=True)
    group.shutdown()
    tables.upsert("rollout", [check_row(result, args, report_header("bench_true_on_policy")["date"])], args.results)
    return 0 if result["decode_vs_actor"]["max"] == 0.0 and result["chunked_vs_actor"]["max"] == 0.0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="grpo_tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gpu-06b", action="store_true", help="Qwen3-0.6B shape, vLLM colocated, one GPU")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for both runs")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run")
    ap.add_argument("--variants", nargs="+", choices=["off", "on"], default=["off", "on"],
                    help="which runs (both for the side by side; the report needs both)")
    tables.add_arguments(ap, "a row per run (rollout)")
    ap.add_argument("--check", action="store_true", help="the per-token check on one GPU (module docstring)")
    ap.add_argument("--prompts", type=int, default=32, help="--check: prompts")
    ap.add_argument("--n", type=int, default=4, help="--check: samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="--check: response tokens")
    ap.add_argument("--cpu", action="store_true", help="--check: a dry run with grpo_tiny's model and the hf engine")
    ap.add_argument("--runs", default=None, help="where the two run directories go (default: --out)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of each variant, in A B B A order (a drift of the shared host's speed cancels)")
    args = ap.parse_args()
    if args.check:
        return check(args)
    device = "cuda" if args.gpu_06b else "cpu"
    base = (GPU_06B if args.gpu_06b else CPU) + [f"trainer.total_steps={args.steps}", *args.set]
    report = {**report_header("bench_true_on_policy", device=device), "runs": {}, "order": []}
    keys = {"off": ["rollout.true_on_policy=false"], "on": ON}
    rows: dict[str, list] = {}
    failed = set()
    for name in run_order(args.variants, args.rounds):
        key = keys[name]
        tag = f"{name}_{len(rows.get(name, [])) + 1}" if args.rounds > 1 else name
        run = run_trainer(args.config, [*base, *key], os.path.join(args.runs or args.out, tag),
                          timeout_s=args.timeout)
        report["order"].append(tag)
        if run["rc"] != 0:
            print(f"bench_true_on_policy: the {tag} run failed (rc {run['rc']}):\n{run['tail']}", file=sys.stderr)
            failed.add(name)
        rows.setdefault(name, []).append(run["rows"])
        report["runs"][name] = {"rc": 1 if name in failed else 0, "wall_s": run["wall_s"],
                                **summary_of_runs(rows[name], profiled_steps([*base, *key]))}
        if len(report["runs"]) == 2:
            write_report(args.out, "bench_true_on_policy", report, markdown(report))
    for name, run in report["runs"].items():
        if name not in failed:
            tables.upsert("rollout", [table_row(name, {**run, "config": [*base, *keys[name]]}, report, args)],
                          args.results)
    if len(report["runs"]) == 2:
        print(open(os.path.join(args.out, "bench_true_on_policy.md")).read())
    else:  # one run: its summary only (no side by side)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_true_on_policy.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps(report["runs"], indent=1))
    return 0 if report["runs"].get("on", {}).get("all_zero", "on" not in args.variants) else 1


if __name__ == "__main__":
    raise SystemExit(main())
