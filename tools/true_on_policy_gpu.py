"""rollout.true_on_policy on one GPU with vLLM (issue 60): the Qwen3-0.6B-shaped random model, vLLM colocated in
process (batch-invariant mode), the Megatron actor on the same weights through the worker the trainer uses. Samples a
batch, then compares per sampled token
  A  vLLM's decode log-probs (what the rollout reports),
  B  vLLM's prefill log-probs of the same full sequences (prompt_logprobs),
  C  the actor's forward (what the trainer recomputes),
and writes true_on_policy_gpu.json to --out: max |difference| and the share of tokens that differ for A-C (the goal:
exactly 0), B-C (the actor against vLLM's own arithmetic on the same layout) and A-B (vLLM's decode against its
prefill), with the generation and actor-forward seconds, and per decoder layer the largest difference of the residual
stream between vLLM's prefill and the actor on one sequence (the first nonzero layer is where the forwards part).
Exit 0 when A == C on every token. --cpu: a dry run of the tool's flow with the hf engine.

  export PYTHONPATH=/tmp/site:$PWD
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \\
    python tools/true_on_policy_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness.cases import GRPO_06B_OVERRIDES


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


def _compare(a, b) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return {"tokens": len(diffs), "max": max(diffs, default=0.0),
            "nonzero_frac": sum(d != 0 for d in diffs) / max(len(diffs), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides")
    ap.add_argument("--cpu", action="store_true", help="a dry run of this tool: grpo_tiny's model and the hf engine "
                    "on CPU (no prefill comparison: that is vLLM's)")
    args = ap.parse_args()
    import torch

    from rltrain.config import validate_config
    from rltrain.config.entry import compose_config
    from rltrain.workers.group import LocalWorkerGroup
    from rltrain.workers.hybrid import HybridWorker

    base = ["trainer.device=cpu"] if args.cpu else [*GRPO_06B_OVERRIDES, "rollout=vllm"]
    overrides = [*base, "trainer.use_ray=false", "rollout.true_on_policy=true", "trainer.fused_linear_logprob_backend=torch",
                 f"rollout.n={args.n}", f"rollout.max_response_length={args.max_tokens}", *args.set]
    cfg = compose_config("grpo_tiny", overrides)
    validate_config(cfg)
    group = LocalWorkerGroup(HybridWorker, worker_kwargs={"cfg": cfg, "roles": ["actor", "rollout"]})
    group.setup()
    w = group.workers[0]
    rng = random.Random(0)
    vocab = int(w.hf_config.vocab_size)
    prompts = [{"prompt_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(4, 65))], "ground_truth": None,
                "data_source": "random"} for _ in range(args.prompts)]
    t0 = time.perf_counter()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    batch, _ = w.generate(prompts, 0, False, 1234)
    sync()
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    old, _ = w.compute_old_logprobs(batch, 1.0)
    sync()
    fwd_s = time.perf_counter() - t0
    mask = batch.loss_mask.bool()
    sequences, a, c, b_idx = [], [], [], []
    for i in range(mask.shape[0]):
        p = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        r = batch.response_ids[i][mask[i]].tolist()
        sequences.append(p + r)
        a += batch.sampler_logprobs[i][mask[i]].tolist()
        c += old[i][mask[i]].tolist()
        b_idx.append((len(p), len(r)))
    result = {"config": overrides, "generate_s": gen_s, "actor_forward_s": fwd_s, "decode_vs_actor": _compare(a, c)}
    llm = getattr(w.rollout.engine, "llm", None)
    if llm is not None:
        pre = _prefill_logprobs(llm, sequences)
        b = [x for row, (np_, nr) in zip(pre, b_idx) for x in row[np_:np_ + nr]]
        result.update(prefill_vs_actor=_compare(b, c), decode_vs_prefill=_compare(a, b))
        try:  # where the forwards part, if they do (a diagnosis: its failure does not fail the check)
            result["layer_max_abs_diff"] = _layer_diffs(w, sequences[0])
        except Exception as err:  # noqa: BLE001
            result["layer_max_abs_diff"] = f"not measured: {type(err).__name__}: {err}"[:500]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "true_on_policy_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1), flush=True)
    group.shutdown()
    return 0 if result["decode_vs_actor"]["max"] == 0.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
