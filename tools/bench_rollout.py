"""Rollout engines side by side on the same random-weight model and prompts: hf vs vllm generation tokens/s,
in-place weight sync seconds per GB, sleep/wake seconds, engine start-up. Writes bench_rollout.json/.md to --out.

  python tools/bench_rollout.py --out /tmp/bench                                   # CPU: tiny shapes
  python tools/bench_rollout.py --out $OUT --shape qwen3-0.6b --device cuda \\
      --batch 256 --prompt-len 64 --response-len 64 --hf-batch 256               # GPU, Qwen3-0.6B shapes
  python tools/bench_rollout.py --out $OUT --shape qwen3-0.6b --device cuda \\
      --batch 256 --prompt-len 128 --response-len 1024 --hf-batch 64

Generation samples at temperature 1 with no EOS, so every response is exactly --response-len tokens;
tokens/s counts generated tokens. Weight sync streams the model's HF state dict (on the engine's device) through
`engine.update_weights` (vLLM: in-place reload, no host round trip). vLLM's CPU build has no sleep mode, so
sleep/wake are reported only on GPU. The first generate of each engine is a warm-up and not timed.
--profile adds one more generate per engine under cProfile (tools/harness/host_profile.py): where the host time goes.
--engines-per-gpu k: k vLLM engines in their own processes share the device (rollout.engines_per_gpu; on a GPU their
weights come by CUDA IPC and every row is timed, on CPU generation only; --profile then sees this process only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import device_name, md_table, report_header, write_report
from harness import results as tables


def build_model(shape: str, dtype: torch.dtype, seed: int, extra: dict | None = None):
    """The random-init model every role starts from (workers/hybrid.initial_hf_model: the built-in preset, seeded,
    weights N(0, 0.02)); tiny with 64 tokens and the head_dim vLLM's CPU kernels take (>= 32)."""
    from types import SimpleNamespace

    from rltrain.config.schema import ModelConfig
    from rltrain.workers.hybrid import initial_hf_model

    overrides = {"head_dim": 32} if shape == "tiny" else {}
    overrides.update(extra or {})
    _, model = initial_hf_model(ModelConfig(builtin=shape, overrides=overrides), SimpleNamespace(vocab_size=64), seed, dtype)
    return model.eval()


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def device_copy(model, device: str) -> dict:
    """A copy of the weights on `device` (tied ones once), as an actor's export would hand them over."""
    return {k: v.detach().to(device, copy=True) for k, v in model.named_parameters()}


def bench_engine(name: str, engine, prompts, args, model, *, sync: bool = True) -> dict:
    """sync=False: generation rows only (an engine that cannot take this process's tensors)."""
    from rltrain.rollout import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=args.response_len, seed=0)
    batch = args.hf_batch if name == "hf" else args.batch
    rows = prompts[:batch]
    engine.generate(rows[:2], SamplingParams(temperature=1.0, max_tokens=4, seed=0))  # warm-up
    times = []
    for _ in range(args.reps):
        out, dt = timed(lambda: engine.generate(rows, sampling), args.device)
        assert all(len(r.token_ids) == args.response_len for r in out), "responses ended early"
        times.append(dt)
    gen_s = min(times)
    res = {"engine": name, "batch": len(rows), "gen_s": gen_s, "gen_tokens_per_s": len(rows) * args.response_len / gen_s}
    if args.profile:  # where the host time of one generate goes (cProfile; harness/host_profile.py)
        from harness.host_profile import profile_call
        from harness.host_profile import to_markdown as profile_markdown

        _, res["host_profile"] = profile_call(engine.generate, rows, sampling)
        with open(os.path.join(args.out, f"profile_{name}.md"), "w") as f:
            f.write(profile_markdown(res["host_profile"], f"{name}: one generate of {len(rows)} x "
                                                          f"{args.response_len} tokens under cProfile"))
    if args.variants:  # what the per-request seeds and the sampler log-probs cost (the trainer asks for both)
        res["variants"] = {}
        for seeded in (True, False):
            for logprobs in (True, False):
                params = SamplingParams(temperature=1.0, max_tokens=args.response_len, seed=0 if seeded else None,
                                        logprobs=logprobs)
                best = min(timed(lambda: engine.generate(rows, params), args.device)[1] for _ in range(args.reps))
                key = f"{'seeded' if seeded else 'unseeded'}, {'log-probs' if logprobs else 'no log-probs'}"
                res["variants"][key] = {"gen_s": best, "ms_per_decode_step": 1e3 * best / args.response_len,
                                        "gen_tokens_per_s": len(rows) * args.response_len / best}
    if not sync:
        return res
    state = device_copy(model, args.device)
    gb = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
    _, sync_s = timed(lambda: engine.update_weights(iter(state.items())), args.device)
    res.update(sync_s=sync_s, sync_gb=gb, sync_s_per_gb=sync_s / gb)
    del state
    if args.device == "cuda":
        # level 1, --reps + 1 times: the first sleep makes the hf engine's pinned host copies, the rest reuse them
        sleeps, wakes = [], []
        for _ in range(args.reps + 1):
            free0 = torch.cuda.mem_get_info()[0]
            sleeps.append(timed(lambda: engine.sleep(level=1), args.device)[1])
            res["sleep_freed_gib"] = (torch.cuda.mem_get_info()[0] - free0) / 2**30
            wakes.append(timed(engine.wake_up, args.device)[1])
        res.update(first_sleep_s=sleeps[0], first_wake_s=wakes[0], sleep_s=min(sleeps[1:]), wake_s=min(wakes[1:]))
        if name == "hf":  # the naive level 1, what the hf engine did before 2026-11-26 (night): pageable copies
            naive_s, naive_w = [], []
            for _ in range(args.reps):
                naive_s.append(timed(lambda: engine.model.to("cpu"), args.device)[1])
                naive_w.append(timed(lambda: engine.model.to(args.device), args.device)[1])
            res.update(naive_sleep_s=min(naive_s), naive_wake_s=min(naive_w))
    res.update(colocated_cycle(engine, model, rows, args))  # on CPU vLLM's sleep/wake only change its state
    return res


def colocated_cycle(engine, model, rows, args) -> dict:
    """What a colocated GRPO step costs the engine: sleep at level 2 (weights dropped), wake, then a full weight
    update from device tensors (workers/rollout.py). Greedy tokens and their log-probs before and after, with
    the same weights, must agree: the reloaded weights are the ones the engine had."""
    from rltrain.rollout import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    probe = rows[:8]
    before = engine.generate(probe, greedy)
    state = device_copy(model, args.device)
    _, sleep2 = timed(lambda: engine.sleep(level=2), args.device)
    _, wake2 = timed(engine.wake_up, args.device)
    _, sync2 = timed(lambda: engine.update_weights(iter(state.items())), args.device)
    del state
    after = engine.generate(probe, greedy)
    same = sum(a.token_ids == b.token_ids for a, b in zip(before, after)) / len(probe)
    diff = max((abs(x - y) for a, b in zip(before, after) if a.token_ids == b.token_ids
                for x, y in zip(a.logprobs, b.logprobs)), default=float("nan"))
    return {"level2_sleep_s": sleep2, "level2_wake_s": wake2, "level2_sync_s": sync2,
            "level2_cycle_s": sleep2 + wake2 + sync2, "level2_same_greedy": same, "level2_logprob_max_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_rollout_out"))
    ap.add_argument("--shape", choices=["tiny", "qwen3-0.6b"], default="tiny")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--overrides", nargs="*", default=[], metavar="KEY=INT",
                    help="HF config overrides, e.g. num_hidden_layers=2 (integers, or true/false)")
    ap.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"])
    ap.add_argument("--batch", type=int, default=64, help="sequences per generate call (vllm)")
    ap.add_argument("--hf-batch", type=int, default=None, help="sequences for the hf engine (default --batch)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--enforce-eager", action="store_true", help="vllm: no CUDA graphs")
    ap.add_argument("--variants", action="store_true",
                    help="also time generation with and without per-request seeds and sampler log-probs")
    ap.add_argument("--engine-process", choices=["this", "own"], default="this",
                    help="vllm: engine core in this process (the trainer's way) or in its own process (vLLM's "
                         "default: output processing overlaps the steps); 'own' times generation only")
    ap.add_argument("--engines-per-gpu", type=int, default=1,
                    help="vllm: this many engines in their own processes share the device (rollout.engines_per_gpu: "
                         "the batch split between them, weights by CUDA IPC)")
    tables.add_arguments(ap, "a row per engine (rollout)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one generate per engine (cProfile: host time by function and package area; "
                         "profile_<engine>.md)")
    args = ap.parse_args()
    args.hf_batch = args.hf_batch or args.batch
    os.makedirs(args.out, exist_ok=True)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    extra = {k: v.lower() == "true" if v.lower() in ("true", "false") else int(v)
             for k, v in (o.split("=", 1) for o in args.overrides)}
    model = build_model(args.shape, dtype, seed=0, extra=extra)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, vocab, (max(args.batch, args.hf_batch), args.prompt_len), generator=g).tolist()
    res = {**report_header("bench_rollout"), "shape": args.shape + (f" {extra}" if extra else ""),
           "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
           "prompt_len": args.prompt_len, "response_len": args.response_len, "results": []}
    for name in args.engines:
        if name == "hf":
            from rltrain.rollout.hf import HFEngine

            engine, start_s = timed(lambda: HFEngine(model, device=args.device, dtype=dtype, eos_token_id=[],
                                                     max_batch_size=args.hf_batch), args.device)
        else:
            import tempfile

            import vllm

            from rltrain.rollout.vllm import VLLMEngine

            res["vllm"] = vllm.__version__
            k = args.engines_per_gpu
            common = dict(device=args.device, dtype=str(dtype).removeprefix("torch."), eos_token_id=[],
                          gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                          max_model_len=args.prompt_len + args.response_len + 8)
            with tempfile.TemporaryDirectory() as path:
                model.save_pretrained(path)
                if k == 1:
                    engine, start_s = timed(lambda: VLLMEngine(path, **common,
                                                               in_process=args.engine_process == "this"), args.device)
                else:  # rollout.engines_per_gpu: engines in their own processes, weights by CUDA IPC (GPU)
                    from rltrain.rollout.vllm import start_engine_pool

                    engine, start_s = timed(lambda: start_engine_pool(path, k, **common), args.device)
                    name = f"vllm-x{k}"
        # an engine in its own process takes this process's tensors only by CUDA IPC (a pool of them on a GPU)
        sync = name == "hf" or (args.engine_process == "this" and args.engines_per_gpu == 1) or (
            args.engines_per_gpu > 1 and args.device == "cuda")
        r = bench_engine(name, engine, prompts, args, model, sync=sync)
        r["start_s"] = start_s
        res["results"].append(r)
        print(json.dumps(r), flush=True)
        if hasattr(engine, "close"):
            engine.close()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    md = to_markdown(res)
    write_report(args.out, "bench_rollout", res, md)
    tables.upsert("rollout", [table_row(r, res, args) for r in res["results"]], args.results)
    print(md)


def table_row(r: dict, res: dict, args) -> dict:
    """One engine's results row: every number it measured (the variants' generate s and ms per decode step beside
    them). A vLLM engine in this process with its sleep measured is a run tools/planlab compares the planner with
    (scope "rollout": its generation time and the memory its sleep freed), with the config that plans it."""
    m = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()
         if isinstance(v, (int, float)) and k != "batch"}
    for name, v in r.get("variants", {}).items():
        m.update({f"{name}/{k}": round(v[k], 4) for k in ("gen_s", "ms_per_decode_step")})
    own = args.engine_process == "own" and r["engine"] == "vllm"
    variant = (f"{'hf' if r['engine'] == 'hf' else 'vLLM'} alone, {r['batch']} x ({res['prompt_len']} + "
               f"{res['response_len']})" + (", engine core in its own process" if own else "")
               + (f", {args.engines_per_gpu} engines" if r["engine"].startswith("vllm-x") else ""))
    gpu = device_name() if args.device == "cuda" else "CPU"
    row = tables.row("bench_rollout", res["shape"], tables.device_kind(gpu), variant, m, date=res["date"])
    if r["engine"] == "vllm" and not own and "sleep_freed_gib" in r and args.shape in ("qwen3-0.6b", "qwen3-4b"):
        row["config"] = ["model=qwen3_0.6b_random", f"model.builtin={args.shape}", "trainer.device=cuda",
                         "trainer.n_gpus_per_node=1", "rollout=vllm", f"data.train_batch_size={r['batch']}",
                         "rollout.n=1", f"data.max_prompt_length={res['prompt_len']}",
                         f"rollout.max_response_length={res['response_len']}", "actor.ppo_mini_batch_size=1",
                         "trainer.use_ray=false", f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}"]
        row["scope"] = "rollout"
    return row


def to_markdown(res: dict) -> str:
    rows = []
    for r in res["results"]:
        if "sync_s" not in r:  # engine in its own process: generation only
            rows.append((f"{r['engine']} (own process)", r["batch"], f"{r['gen_s']:.2f}", f"{r['gen_tokens_per_s']:,.0f}",
                         f"{r['start_s']:.1f}", "n/a", "n/a", "n/a", "n/a"))
            continue
        naive = (f"; model.to(cpu) / .to(cuda): {r['naive_sleep_s']:.3f} / {r['naive_wake_s']:.3f}"
                 if "naive_sleep_s" in r else "")
        sleep = (f"{r['sleep_s']:.3f} / {r['wake_s']:.3f} (first {r['first_sleep_s']:.3f} / {r['first_wake_s']:.3f}; "
                 f"{r['sleep_freed_gib']:.1f} GiB freed{naive})") if "sleep_s" in r \
            else "n/a on CPU"
        cycle = (f"{r['level2_sleep_s']:.2f} + {r['level2_wake_s']:.2f} + {r['level2_sync_s']:.2f} = "
                 f"{r['level2_cycle_s']:.2f}")
        same = f"{100 * r['level2_same_greedy']:.0f}% (log-prob max diff {r['level2_logprob_max_diff']:.1e})"
        rows.append((r["engine"], r["batch"], f"{r['gen_s']:.2f}", f"{r['gen_tokens_per_s']:,.0f}", f"{r['start_s']:.1f}",
                     f"{r['sync_s_per_gb']:.2f} ({r['sync_gb']:.3f})", sleep, cycle, same))
    lines = [f"`{res['command']}` ({res['date']}, {res['device']}, torch {res['torch']}"
             + (f", vLLM {res['vllm']}" if "vllm" in res else "") + f"), {res['shape']} shapes ({res['params_m']:.1f}M params), "
             f"prompt {res['prompt_len']} + response {res['response_len']} tokens:", "",
             md_table(["engine", "sequences", "generate s", "tokens/s", "start s", "weight sync s/GB (GB)",
                       "level-1 sleep s / wake s", "colocated cycle: sleep(2) + wake + sync s", "greedy same after it"], rows)]
    variants = [(r["engine"], k, v) for r in res["results"] for k, v in r.get("variants", {}).items()]
    if variants:
        lines += ["", md_table(["engine", "sampling", "generate s", "ms per decode step", "tokens/s"],
                               [(e, k, f"{v['gen_s']:.2f}", f"{v['ms_per_decode_step']:.1f}", f"{v['gen_tokens_per_s']:,.0f}")
                                for e, k, v in variants])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
