"""GPU end-to-end validation and benchmarks in one call: writes gpu_smoke.json + gpu_smoke.md to --out.

Sections (each can be skipped): `grpo` (a few GRPO steps of a Qwen3-0.6B-shaped random model through the real
trainer, in-process, fused Triton head, HF rollout), `parity` (Megatron bf16 per-token log-probs vs the
transformers model, TP=1), `step8k` (timed actor update at 8k tokens per micro-batch: tokens/s, MFU),
`longctx` (actor update at 32k / 64k tokens per micro-batch, fused vs unfused head: time and peak memory; OOM is a
result), `tp2` (2 GPUs: TP=2 log-probs vs TP=1 on the same weights, and the TP=2 update step time).

  python tools/gpu_smoke.py --out $OUT                 # one GPU: grpo, parity, step8k, longctx
  python tools/gpu_smoke.py --out $OUT --only tp2      # two GPUs
  python tools/gpu_smoke.py --out $OUT --only grpo --grpo-engine vllm   # the GRPO step with the vLLM rollout
  # the step's opt-in levers (issue #35) through --grpo-set: rollout.free_cache_engine=false (no sleep/wake),
  # actor.recompute_old_logprobs=false (with actor.ppo_mini_batch_size = data.train_batch_size: no old-log-prob pass)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import device_name, gemm_tflops, md_table, report_header, run_json_child, time_ms, write_report
from harness import results as tables
from harness.cases import GRPO_06B_OVERRIDES, Row, actor_engine, hf_config, policy_loss_fn, policy_micro_batch
from harness.runs import STEP_METRICS
from harness.host_profile import profile_call
from harness.host_profile import to_markdown as profile_markdown

from rltrain.utils.flops import peak_flops, train_flops
from rltrain.workers.base import free_port, publish_dist_env


def peak_tflops() -> float:
    return peak_flops(device_name()) / 1e12


def build_engine(cfg, *, fused: bool, backend: str = "auto", tp: int = 1, max_tokens: int = 65536,
                 recompute: bool = False):
    from rltrain.config.schema import LayerComputeConfig

    return actor_engine(cfg, tokens=max_tokens, device="cuda", dtype=torch.bfloat16, tp=tp, fused=fused,
                        backend=backend, compute=LayerComputeConfig(recompute_activations=recompute), weight_decay=0.0)


def timed_update(engine, mb: dict, reps: int = 2) -> dict:
    loss = policy_loss_fn()
    engine.train_step([dict(mb)], loss)  # warm-up (compiles kernels, allocates optimizer state)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step_ms = time_ms(lambda: engine.train_step([dict(mb)], loss), reps=reps, warmup=0, cuda=True)
    return {"step_s": step_ms / 1e3, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


# --------------------------------------------------------------------------- sections
def section_grpo(out_dir: str, steps: int, engine: str = "hf", extra: tuple[str, ...] = (),
                 profile_gen: bool = False) -> dict:
    """profile_gen: the last step's generation (the steps-th generate call: one per step here, no validation,
    no dynamic sampling) runs under cProfile (harness/host_profile.py; written to profile_gen_<engine>.md) and that
    step is left out of the means."""
    from rltrain.config import validate_config
    from rltrain.config.entry import compose_config
    from rltrain.trainer.ppo import run_from_config
    from rltrain.utils.tracking import read_metrics

    overrides = ["trainer.use_ray=false", *GRPO_06B_OVERRIDES, f"trainer.total_steps={steps}"] + (
        ["rollout=vllm"] if engine == "vllm" else []) + list(extra)  # vllm colocated: sleeps during the update
    cfg = compose_config("grpo_tiny", overrides)
    validate_config(cfg)
    run_dir = os.path.join(out_dir, f"grpo_run_{engine}")
    torch.cuda.reset_peak_memory_stats()
    profiled: dict = {}
    with _profiled_generation(steps, profiled) if profile_gen else contextlib.nullcontext():
        run_from_config(cfg, run_dir)
    rows = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    steady = rows[1:] or rows  # the first step compiles kernels
    if profiled and len(steady) > 1:
        steady = steady[:-1]  # the profiled step's times are cProfile's
    keys = ["timing_s/gen", "timing_s/gen_engine", "timing_s/reward", "timing_s/rollout_sleep", "timing_s/old_log_prob",
            "timing_s/ref", "timing_s/update_actor", "timing_s/update_weights", "timing_s/rollout_wake", "timing_s/step",
            "perf/throughput", "perf/max_memory_allocated_gb", "response_length/mean", "prompt_length/mean"]
    # phases only some configs have (a critic's, the wake-up's parts, the reserved peak): when the log has them
    keys += [k for k in ("timing_s/values", "timing_s/update_critic", "timing_s/rollout_wake_empty_cache",
                         "timing_s/rollout_wake_engine", "perf/max_memory_reserved_gb") if k in steady[-1]]
    mean = {k: sum(r.get(k, 0.0) for r in steady) / len(steady) for k in keys}
    samples = cfg.data.train_batch_size * cfg.rollout.n  # sequences per step
    # generation phase: response tokens sampled per second
    mean["gen_response_tokens_per_s"] = mean["response_length/mean"] * samples / max(mean["timing_s/gen"], 1e-9)
    finite = all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf")
                 for r in rows for v in r.values() if isinstance(v, (int, float)))
    assert finite, "non-finite metric in the GPU GRPO run"
    hf_cfg = hf_config(cfg.model.builtin or "qwen3-0.6b")  # the shape that ran (model.builtin=qwen3-4b: the 4B's)
    # update phase: actor forward+backward over every token of the batch (prompt + response)
    tok = sum(r["perf/total_num_tokens"] for r in steady) / len(steady)
    seq = tok / samples
    flops = train_flops(hf_cfg, tok, seq)
    mfu = flops / mean["timing_s/update_actor"] / (peak_tflops() * 1e12)
    if profiled:
        with open(os.path.join(out_dir, f"profile_gen_{engine}.md"), "w") as f:
            f.write(profile_markdown(profiled["summary"], f"GRPO step {steps}: generation ({engine} engine, "
                                                          "RolloutRole.generate) under cProfile"))
    return {"engine": engine, "model": cfg.model.builtin or cfg.model.path, "overrides": overrides, "steps": len(rows),
            "steady_steps": len(steady), "mean": mean, "tokens_per_step": tok,
            "update_mfu": mfu, "all_finite": finite, **({"gen_profile": profiled["summary"]} if profiled else {}),
            "last": {k: rows[-1][k] for k in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm",
                                              "actor/entropy", "actor/kl_loss", "rollout/logprob_diff_max",
                                              "rollout/mismatch_abs_mean", "rollout/mismatch_kl")}}


@contextlib.contextmanager
def _profiled_generation(call: int, into: dict):
    """Profile the `call`-th RolloutRole.generate of this process (cProfile); its summary lands in into["summary"]."""
    from rltrain.workers.rollout import RolloutRole

    original, calls = RolloutRole.generate, [0]

    def generate(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] != call:
            return original(self, *args, **kwargs)
        out, into["summary"] = profile_call(original, self, *args, **kwargs)
        return out

    RolloutRole.generate = generate
    try:
        yield
    finally:
        RolloutRole.generate = original


def section_parity() -> dict:
    """Megatron (bf16, fused Triton head) per-token log-probs/entropy vs transformers' Qwen3 (bf16) on the same
    weights, and both vs the transformers model in fp32 (the reference)."""
    from transformers import Qwen3ForCausalLM

    cfg = hf_config("qwen3-0.6b")
    cfg.num_hidden_layers = 4  # parity needs the layer math, not depth; keeps the fp32 reference small
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).cuda()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    eng = build_engine(cfg, fused=True, backend="triton")
    eng.load_hf_weights(sd)
    b, s = 4, 512
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    seq_lens = torch.tensor([512, 400, 300, 17])
    mask = torch.arange(s)[None, :] < seq_lens[:, None]
    label_mask = mask.clone()
    label_mask[:, 0] = False
    lp, ent = eng.forward_logprobs(ids, seq_lens, label_mask, with_entropy=True)
    with torch.no_grad():
        logits = hf(input_ids=ids.cuda(), attention_mask=mask.long().cuda()).logits.double()
        ref_lp_all = torch.log_softmax(logits[:, :-1], -1)
        ref_lp = torch.zeros(b, s, dtype=torch.float64, device="cuda")
        ref_lp[:, 1:] = ref_lp_all.gather(-1, ids[:, 1:].cuda()[..., None])[..., 0]
        p = ref_lp_all.exp()
        ref_ent = torch.zeros_like(ref_lp)
        ref_ent[:, 1:] = -(p * ref_lp_all).sum(-1)
    m = label_mask.cuda()
    lp, ent = lp.cuda().double(), ent.cuda().double()
    return {"tokens": int(m.sum()), "vocab": cfg.vocab_size, "layers": cfg.num_hidden_layers,
            "logprob_max_abs_err": (lp - ref_lp)[m].abs().max().item(),
            "logprob_mean_abs_err": (lp - ref_lp)[m].abs().mean().item(),
            "entropy_max_abs_err": (ent - ref_ent)[m].abs().max().item(),
            "entropy_mean_abs_err": (ent - ref_ent)[m].abs().mean().item(),
            "note": "megatron bf16 params vs transformers fp32 model on the same weights; hf in fp32 here"}


def section_step(tokens: int, fused: bool, backend: str = "triton", recompute: bool = False) -> dict:
    cfg = hf_config("qwen3-0.6b")
    try:
        eng = build_engine(cfg, fused=fused, backend=backend, max_tokens=tokens, recompute=recompute)
        ids = torch.randint(0, cfg.vocab_size, (1, tokens))
        res = timed_update(eng, policy_micro_batch(ids))
        flops = train_flops(cfg, tokens, tokens)
        res.update(tokens=tokens, fused=fused, recompute=recompute, tokens_per_s=tokens / res["step_s"],
                   mfu=flops / res["step_s"] / (peak_tflops() * 1e12), status="ok")
    except torch.OutOfMemoryError as err:
        res = {"tokens": tokens, "fused": fused, "recompute": recompute, "status": "OOM", "error": str(err).splitlines()[0][:200]}
    finally:
        eng = None
        torch.cuda.empty_cache()
    return res


def _tp2_worker(rank: int, port: int, path: str, tokens: int):
    publish_dist_env(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, local_rank=rank)
    torch.cuda.set_device(rank)
    cfg = hf_config("qwen3-0.6b")
    sd = torch.load(os.path.join(path, "weights.pt"), weights_only=True)
    inputs = torch.load(os.path.join(path, "inputs.pt"), weights_only=True)
    eng = build_engine(cfg, fused=True, backend="triton", tp=2)
    eng.load_hf_weights(sd)
    lp, ent = eng.forward_logprobs(inputs["ids"], inputs["seq_lens"], inputs["label_mask"], with_entropy=True)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    res = timed_update(eng, policy_micro_batch(ids))
    if rank == 0:
        torch.save({"lp": lp.cpu(), "ent": ent.cpu(), "step": res}, os.path.join(path, "tp2.pt"))


def section_tp2(tokens: int = 8192) -> dict:
    import torch.multiprocessing as mp

    assert torch.cuda.device_count() >= 2, "tp2 needs 2 GPUs"
    from rltrain.config.schema import ModelConfig
    from rltrain.workers.hybrid import initial_hf_model  # the random init every role starts from

    path = tempfile.mkdtemp()
    # (qwen3-0.6b keeps its own vocabulary: the tokenizer's size is not read)
    cfg, hf = initial_hf_model(ModelConfig(builtin="qwen3-0.6b"), SimpleNamespace(vocab_size=1), 0, torch.float32)
    sd = {k: v.detach().to(torch.bfloat16) for k, v in hf.state_dict().items()}
    del hf
    torch.save(sd, os.path.join(path, "weights.pt"))
    b, s = 4, 1024
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    seq_lens = torch.tensor([1024, 700, 300, 33])
    label_mask = (torch.arange(s)[None, :] < seq_lens[:, None])
    label_mask[:, 0] = False
    torch.save({"ids": ids, "seq_lens": seq_lens, "label_mask": label_mask}, os.path.join(path, "inputs.pt"))
    port = free_port()
    mp.spawn(_tp2_worker, args=(port, path, tokens), nprocs=2, join=True)
    tp2 = torch.load(os.path.join(path, "tp2.pt"), weights_only=True)
    # TP=1 on the same weights, in this process
    publish_dist_env(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), local_rank=0)
    eng = build_engine(cfg, fused=True, backend="triton", tp=1)
    eng.load_hf_weights({k: v.float() for k, v in sd.items()})
    lp1, ent1 = eng.forward_logprobs(ids, seq_lens, label_mask, with_entropy=True)
    t1 = timed_update(eng, policy_micro_batch(torch.randint(0, cfg.vocab_size, (1, tokens),
                                                            generator=torch.Generator().manual_seed(1))))
    m = label_mask
    return {"tokens_compared": int(m.sum()),
            "logprob_max_abs_diff_tp2_vs_tp1": (tp2["lp"] - lp1.cpu())[m].abs().max().item(),
            "logprob_mean_abs_diff_tp2_vs_tp1": (tp2["lp"] - lp1.cpu())[m].abs().mean().item(),
            "entropy_max_abs_diff_tp2_vs_tp1": (tp2["ent"] - ent1.cpu())[m].abs().max().item(),
            "update_step_tp2": tp2["step"], "update_step_tp1": t1, "update_tokens": tokens}


def to_markdown(res: dict) -> str:
    lines = [f"# GPU smoke ({res['date']}, {res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`", f"Measured bf16 GEMM ceiling: {res.get('gemm_tflops', 0):.0f} TFLOP/s; "
             f"MFU below is against the {peak_tflops():.0f} TFLOP/s datasheet peak.", ""]
    if "grpo" in res and "error" not in res["grpo"]:
        g = res["grpo"]
        mean = g["mean"]
        lines += [f"## GRPO, {g.get('model', 'qwen3-0.6b')} shapes (random init), fused Triton head, "
                  f"{g.get('engine', 'hf')} rollout, 1 GPU", "", md_table(["phase", "mean s/step"],
                                        [(k, f"{v:.3f}") for k, v in mean.items() if k.startswith("timing_s/")]),
                  "", f"generation {mean.get('gen_response_tokens_per_s', 0):.0f} response tokens/s; "
                  f"tokens/step {g['tokens_per_step']:.0f}; throughput {mean['perf/throughput']:.0f} tok/s; "
                  f"update-phase MFU {100 * g['update_mfu']:.1f}%; peak GPU memory "
                  f"{mean['perf/max_memory_allocated_gb']:.1f} GiB; all metrics finite: {g['all_finite']}", ""]
    if "parity" in res and "error" not in res["parity"]:
        p = res["parity"]
        lines += ["## Per-token log-prob parity, Megatron bf16 (fused Triton) vs transformers fp32", "",
                  f"{p['tokens']} tokens, V={p['vocab']}, {p['layers']} layers: log-prob max/mean abs err "
                  f"{p['logprob_max_abs_err']:.3g}/{p['logprob_mean_abs_err']:.3g}; entropy "
                  f"{p['entropy_max_abs_err']:.3g}/{p['entropy_mean_abs_err']:.3g}", ""]
    steps = [v for k, v in res.items() if k.startswith(("step8k", "longctx"))]
    if steps:
        rows = []
        for r in [x for v in steps for x in (v if isinstance(v, list) else [v])]:
            if "tokens" not in r:
                rows.append(("-", "-", "-", f"error: {str(r.get('error'))[:120]}", "-", "-", "-", "-"))
                continue
            head = (r["tokens"], "fused" if r["fused"] else "unfused", r.get("recompute"))
            rows.append((*head, "ok", f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f}%",
                         f"{r['peak_gib']:.1f}") if r.get("status") == "ok" else (*head, r.get("status"), "-", "-", "-", "-"))
        lines += ["## Actor update step (Qwen3-0.6B shapes, one micro-batch)", "",
                  md_table(["tokens", "head", "recompute", "status", "s/step", "tokens/s", "MFU", "peak GiB"], rows), ""]
    if "tp2" in res and "error" not in res["tp2"]:
        t = res["tp2"]
        lines += ["## Tensor parallel 2 vs 1 (same weights)", "",
                  f"log-prob max/mean abs diff {t['logprob_max_abs_diff_tp2_vs_tp1']:.3g}/"
                  f"{t['logprob_mean_abs_diff_tp2_vs_tp1']:.3g} over {t['tokens_compared']} tokens; "
                  f"entropy max abs diff {t['entropy_max_abs_diff_tp2_vs_tp1']:.3g}; update step "
                  f"({t['update_tokens']} tokens): TP=2 {t['update_step_tp2']['step_s']:.3f} s, "
                  f"TP=1 {t['update_step_tp1']['step_s']:.3f} s", ""]
    for k, v in res.items():
        if isinstance(v, dict) and "error" in v:
            lines += [f"- section {k} failed: {v['error'][:300]}"]
    return "\n".join(lines) + "\n"


def table_rows(name: str, out, res: dict, args) -> list[tuple[str, dict]]:
    """A finished section as (area, results row)s: the GRPO steps (placements, scope "step": their means, as
    tools/planlab reads them), each update step (update, scope "update": its peak and step time, or fits 0 when it
    ran out of memory), the TP=2 section's two steps and its log-prob agreement."""
    if not out or (isinstance(out, dict) and "error" in out):
        return []
    tag = f" ({args.tag})" if args.tag else ""
    date, gpu = res["date"], device_name()
    if name == "grpo":
        m = {k: v for k, v in out["mean"].items() if k in STEP_METRICS or k.startswith("perf/max_memory")}
        m.update(tokens_per_step=out["tokens_per_step"], gemm_tflops=res.get("gemm_tflops", 0.0))
        variant = f"grpo {out['engine']}" + (f", {' '.join(args.grpo_set)}" if args.grpo_set else "") + tag
        row = tables.row("gpu_smoke", out["model"], tables.device_kind(gpu), variant, m, date=date,
                         config=out["overrides"])
        row["scope"] = "step"
        return [("placements", row)]
    if name == "tp2":
        rows = [tables.row("gpu_smoke", "qwen3-0.6b", tables.device_kind(gpu, 2), f"tp2: update step TP={tp}, 8k tokens"
                           + tag, {"step_s": out[f"update_step_tp{tp}"]["step_s"],
                                   "peak_gib": out[f"update_step_tp{tp}"]["peak_gib"], "tokens": out["update_tokens"]},
                           date=date) for tp in (2, 1)]
        rows.append(tables.row("gpu_smoke", "qwen3-0.6b", tables.device_kind(gpu, 2), "tp2: log-probs TP=2 vs TP=1" + tag,
                               {k: v for k, v in out.items() if k.startswith(("tokens_compared", "logprob_", "entropy_"))},
                               date=date))
        return [("update", r) for r in rows]
    done = []
    for step in out if isinstance(out, list) else []:
        variant = f"smoke-{step['tokens'] // 1024}k-{'fused' if step['fused'] else 'unfused'}-rc{int(step['recompute'])}"
        cfg = Row(name=variant, tokens=step["tokens"], head="fused" if step["fused"] else "unfused",
                  recompute="full" if step["recompute"] else "none").overrides()
        m = ({k: step[k] for k in ("peak_gib", "step_s", "mfu", "tokens_per_s")} if step["status"] == "ok"
             else {"fits": 0.0} if step["status"] == "OOM" else None)
        if m is not None:
            row = tables.row("gpu_smoke", "qwen3-0.6b", tables.device_kind(gpu), variant + tag, m, date=date, config=cfg)
            row["scope"] = "update"
            done.append(("update", row))
    return done


def run_section(name: str, args) -> object:
    if name == "grpo":
        return section_grpo(args.out, args.grpo_steps, args.grpo_engine, tuple(args.grpo_set), args.profile_gen)
    if name == "parity":
        return section_parity()
    if name == "step8k":
        return [section_step(8192, True), section_step(8192, False), section_step(8192, True, recompute=True)]
    if name == "longctx":  # activations recomputed so the head is what differs
        return [section_step(n, fused, recompute=True) for n in (32768, 65536) for fused in (True, False)]
    if name == "tp2":
        return section_tp2()
    raise ValueError(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_smoke_out"))
    ap.add_argument("--only", nargs="*", default=["grpo", "parity", "step8k", "longctx"],
                    choices=["grpo", "parity", "step8k", "longctx", "tp2"])
    ap.add_argument("--grpo-steps", type=int, default=4)
    ap.add_argument("--grpo-engine", choices=["hf", "vllm"], default="hf",
                    help="rollout engine of the grpo section (vllm: colocated, sleeps during the update)")
    ap.add_argument("--grpo-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more Hydra overrides for the grpo section, e.g. actor.elementwise_fusion=compile "
                         "(issue 17's update-phase levers; the first steps then compile: use --grpo-steps 6)")
    ap.add_argument("--profile-gen", action="store_true",
                    help="grpo: run the last step's generation under cProfile (host time by function; "
                         "profile_gen_<engine>.md) and leave that step out of the means")
    tables.add_arguments(ap, "each section's rows (placements, update)", tag=True)
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.section:  # child process: one section, fresh GPU memory
        try:
            out = run_section(args.section, args)
        except Exception as err:  # a failed section is a result; the others still run
            out = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        with open(os.path.join(args.out, f"section_{args.section}.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
        return
    res = report_header("gpu_smoke")
    res["gemm_tflops"] = gemm_tflops()
    torch.cuda.empty_cache()
    for name in args.only:
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", args.out,
               "--grpo-steps", str(args.grpo_steps), "--grpo-engine", args.grpo_engine,
               *(["--grpo-set", *args.grpo_set] if args.grpo_set else []),
               *(["--profile-gen"] if args.profile_gen else [])]
        res[name], run = run_json_child(cmd, os.path.join(args.out, f"section_{name}.json"))  # output: the console
        if res[name] is None:
            res[name] = {"error": f"section process exited with {run['rc']} and wrote nothing"}
        res.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        print(f"[gpu_smoke] {name}: {time.time() - t0:.0f} s", flush=True)
        write_report(args.out, "gpu_smoke", res, to_markdown(res))
        for area, row in table_rows(name, res[name], res, args):
            tables.upsert(area, [row], args.results)
    print(to_markdown(res))


if __name__ == "__main__":
    main()
