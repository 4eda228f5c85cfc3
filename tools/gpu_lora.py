"""LoRA on one GPU (issue 61): Qwen3-8B's shape (random weights), LoRA rank 32 on every linear, vLLM colocated.
Writes lora.json + lora.md (and the GRPO run's metrics.jsonl as grpo_metrics.jsonl) to --out, nothing else.

Sections, each in a child process of its own (fresh GPU memory; a failed one is a result, the other still runs):
  grpo   the real trainer in process: GRPO steps with actor.lora.rank=32 and the KL loss (its reference is the actor
         with its adapters off), vLLM colocated (sleeping at level 1 through the training phases: only the adapters
         come back): the step table (timing_s/* by phase), update_weights seconds (the adapters alone; their bytes),
         memory measured (perf/max_memory_*_gb) beside the plan's, and the plan of the same run as full fine-tuning
         (it does not fit one H200: planned only).
  actor  the actor's update step alone (no vLLM, no reference), LoRA and full fine-tuning on the same micro-batch
         (16 rows of 69 tokens): torch's peak allocated memory measured (OOM is a result) beside the plan's for both.

  peft   (not in the default run) the actor's LoRA against PEFT's on a tiny Qwen3 in fp32: log-probs, every
         adapter's gradient, and the exported PEFT directory loaded with PeftModel.from_pretrained (needs peft).

  python tools/gpu_lora.py --out $OUT               # grpo + actor: at most 8 minutes on one H200 (6 + 2 deadlines)
  python tools/gpu_lora.py --out $OUT --only peft   # about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import md_table, report_header, run_json_child, write_report  # noqa: E402
from harness.cases import GRPO_06B_OVERRIDES, policy_loss_fn, policy_micro_batch  # noqa: E402

RANK = 32
# the GRPO_06B shape (32 prompts x 8 samples, 64-token responses) on Qwen3-8B's shape, vLLM colocated
GRPO = [*GRPO_06B_OVERRIDES, "model.builtin=qwen3-8b", "rollout=vllm", "actor.lr=1e-5"]
LORA = [f"actor.lora.rank={RANK}", "actor.lora.alpha=64"]
ACTOR_ROWS, ACTOR_LEN = 16, 69  # the actor section's micro-batch (the GRPO run's rows: 5-token prompts + 64)
PHASES = ("gen", "old_log_prob", "ref", "update_actor", "rollout_sleep", "rollout_wake", "update_weights", "step")
GIB = 2**30


def _compose(overrides):
    from rltrain.config import validate_config
    from rltrain.config.entry import compose_config

    cfg = compose_config("grpo_tiny", list(overrides))
    validate_config(cfg)
    return cfg


def _plan(overrides) -> dict:
    """The plan's peak on the device, its allocated-counter prediction and whether it fits (GPU 0), at the synthetic
    task's longest prompt (5 tokens: what the trainer's own plan reads from the data)."""
    from rltrain.plan import make_plan

    cfg = _compose([*overrides, "data.max_prompt_length=5"])
    plan = make_plan(cfg, device="h200")
    g = plan.gpus[0]
    return {"peak_gib": g.peak_bytes / GIB, "allocated_gib": g.allocator_peak_bytes / GIB, "fits": plan.fits,
            "peak_phase": g.peak().name, "seconds": plan.seconds}


def section_grpo(out_dir: str, steps: int) -> dict:
    from rltrain.plan.inputs import read
    from rltrain.plan.lora import lora_params
    from rltrain.trainer.ppo import run_from_config
    from rltrain.utils.tracking import read_metrics

    overrides = ["trainer.use_ray=false", *GRPO, *LORA, f"trainer.total_steps={steps}"]
    cfg = _compose(overrides)
    run_dir = tempfile.mkdtemp(prefix="gpu_lora_run_")  # outside --out: only the report files come back
    t0 = time.time()
    run_from_config(cfg, run_dir)
    rows = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    with open(os.path.join(out_dir, "grpo_metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    x = read(cfg)
    adapter_params = lora_params(x, x.shape.sparse)  # TP=1: the whole adapter, what each sync sends
    table = [{"step": r["step"], **{p: r.get(f"timing_s/{p}") for p in PHASES},
              "max_allocated_gib": r.get("perf/max_memory_allocated_gb"),
              "max_reserved_gib": r.get("perf/max_memory_reserved_gb"),
              "plan_allocated_gib": r.get("perf/plan_max_memory_allocated_gb/gpu0"),
              "plan_peak_gib": r.get("perf/plan_peak_gib/gpu0"),
              "logprob_diff_max": r.get("rollout/logprob_diff_max"), "kl_loss": r.get("actor/kl_loss")}
             for r in rows]
    return {"overrides": overrides, "wall_s": time.time() - t0, "steps": table,
            "adapter_params": adapter_params, "adapter_sync_mb": adapter_params * 2 / 2**20,
            "plan_lora": _plan(overrides), "plan_full": _plan([o for o in overrides if not o.startswith("actor.lora")])}


def section_actor() -> dict:
    """The actor update alone: LoRA, then full fine-tuning, each built fresh (random init on the GPU)."""
    import torch

    from rltrain.config.schema import LogprobHeadConfig, LoraConfig, OptimizerConfig
    from rltrain.models.builder import build_engine
    from rltrain.models.presets import hf_config_for
    from rltrain.plan.inputs import read
    from rltrain.plan.memory import train_static, update_phase

    hf = hf_config_for(path=None, builtin="qwen3-8b")
    ids = torch.randint(0, hf.vocab_size, (ACTOR_ROWS, ACTOR_LEN))
    # the plan of this micro-batch: one mini-batch of ACTOR_ROWS rows of 5 + 64 tokens, no reference, no rollout
    shape = [*GRPO, "actor.use_kl_loss=false", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
             "data.max_prompt_length=5", f"actor.max_tokens_per_micro_batch={ACTOR_ROWS * ACTOR_LEN}"]
    out = {}
    for name, lora in (("lora", LoraConfig(rank=RANK, alpha=64.0)), ("full", LoraConfig())):
        x = read(_compose(shape + (LORA if lora.rank else [])))
        planned = update_phase(x, 0, train_static(x, 0), critic=False).torch_bytes / GIB
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        res = {"planned_allocated_gib": planned}
        eng = None
        try:
            eng = build_engine(hf, role="actor", dtype=torch.bfloat16, device="cuda", seed=0, total_steps=10,
                               max_tokens_per_micro_batch=ACTOR_ROWS * ACTOR_LEN, optim=OptimizerConfig(lr=1e-5),
                               head=LogprobHeadConfig(fused_linear_logprob_backend="triton"), lora=lora)
            res["weights_gib"] = torch.cuda.memory_allocated() / GIB
            res["trainable_params"] = sum(p.numel() for p in eng.optim.params)
            for i in range(2):  # the first step allocates AdamW's state
                torch.cuda.synchronize()
                t = time.perf_counter()
                eng.train_step([policy_micro_batch(ids, seed=i)], policy_loss_fn())
                torch.cuda.synchronize()
                res[f"step{i + 1}_s"] = time.perf_counter() - t
            res["measured_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            res["status"] = "ok"
        except torch.OutOfMemoryError as err:
            res.update(status="OOM", error=str(err).splitlines()[0][:300],
                       measured_allocated_gib=torch.cuda.max_memory_allocated() / GIB)
        finally:
            eng = None
            torch.cuda.empty_cache()
        out[name] = res
        from rltrain.models.megatron.compat import teardown_parallel

        teardown_parallel()
    return out


def section_peft(out_dir: str) -> dict:
    """The actor's LoRA against PEFT's on the transformers model (tiny Qwen3, fp32, random nonzero B, on the GPU):
    log-probs and every adapter's gradient; the PEFT directory the export writes, loaded with
    PeftModel.from_pretrained, gives the same log-probs."""
    import torch
    from peft import LoraConfig as PeftLora
    from peft import PeftModel, get_peft_model
    from transformers import Qwen3ForCausalLM

    from rltrain.config.schema import LogprobHeadConfig, LoraConfig
    from rltrain.models.engine_config import EngineConfig
    from rltrain.models.hf_export import save_peft_adapter
    from rltrain.models.loss_protocol import MicroBatch
    from rltrain.models.megatron import MegatronEngine, tiny_qwen3_config

    V, r, alpha = 301, 4, 6.0

    def base():
        torch.manual_seed(3)
        m = Qwen3ForCausalLM(tiny_qwen3_config(V)).float()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(3.0)
        return m.cuda().eval()

    hf = base()
    eng = MegatronEngine(hf.config, EngineConfig(lora=LoraConfig(rank=r, alpha=alpha),
                                                 head=LogprobHeadConfig(fused_linear_logprob_backend="torch")),
                         device="cuda")
    eng.load_hf_weights({k: v.cpu() for k, v in hf.state_dict().items()})
    g = torch.Generator().manual_seed(5)
    ad = {n: torch.randn(t.shape, generator=g) * 0.2 for n, t in eng.lora.export()}
    eng.lora.load(ad)
    peft_model = get_peft_model(base(), PeftLora(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    named = dict(peft_model.named_parameters())
    with torch.no_grad():
        for n, t in ad.items():
            named[n.replace(".weight", ".default.weight")].copy_(t)
    lens = torch.tensor([17, 9, 2, 30])
    ids = torch.randint(0, V, (4, 30), generator=g)
    mask = (torch.arange(30)[None] < lens[:, None]) & (torch.arange(30)[None] >= 1)
    w = torch.randn(4, 30, generator=g) * mask

    def peft_logprobs(model):
        logp = torch.log_softmax(model(ids.cuda()).logits.double()[:, :-1], -1)
        return torch.where(mask[:, 1:].cuda(), logp.gather(-1, ids[:, 1:, None].cuda()).squeeze(-1), 0.0)

    ref = peft_logprobs(peft_model)
    (ref * w[:, 1:].cuda()).sum().backward()
    eng.model.train()
    out = eng._outputs(MicroBatch(input_ids=ids, seq_lens=lens, label_mask=mask), temperature=1.0, entropy_grad=False)
    (out.logprobs * w.cuda()).sum().backward()
    grads = {name: p.grad for a in eng.lora.linears for name, _, p in a.local_named()}
    grad_err = max(float((grads[n].double() - named[n.replace(".weight", ".default.weight")].grad.double()).abs().max()
                         / named[n.replace(".weight", ".default.weight")].grad.abs().max()) for n in ad)
    adapter_dir = tempfile.mkdtemp(prefix="gpu_lora_peft_")
    save_peft_adapter(adapter_dir, eng.lora.spec, dict(eng.lora.export()))
    with torch.no_grad():
        loaded = peft_logprobs(PeftModel.from_pretrained(base(), adapter_dir).eval())
        eng.model.eval()
        lp, _ = eng.forward_logprobs(ids, lens, mask)
    return {"logprob_err_vs_peft": float((out.logprobs[:, 1:].double().cuda() - ref.detach()).abs().max()),
            "grad_rel_err_vs_peft": grad_err, "adapters": len(ad),
            "export_logprob_err_peft_from_pretrained": float((lp[:, 1:].double().cuda() - loaded).abs().max())}


def _f(v, nd=2) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def to_markdown(res: dict) -> str:
    lines = [f"# LoRA rank {RANK} on Qwen3-8B's shape, one GPU ({res.get('device')}, {res.get('date')})", "",
             f"`{res.get('command')}`", ""]
    g = res.get("grpo") or {}
    if "steps" in g:
        lines += ["## GRPO steps (vLLM colocated, KL loss against the base: the actor with adapters off)", "",
                  md_table(["step", *PHASES, "max alloc GiB", "plan alloc GiB", "plan peak GiB", "logprob diff max"],
                           [[s["step"], *(_f(s[p]) for p in PHASES), _f(s["max_allocated_gib"], 1),
                             _f(s["plan_allocated_gib"], 1), _f(s["plan_peak_gib"], 1), _f(s["logprob_diff_max"], 4)]
                            for s in g["steps"]]), "",
                  f"Each sync sends the adapters alone: {g['adapter_params'] / 1e6:.1f} M parameters, "
                  f"{g['adapter_sync_mb']:.0f} MiB in bf16. Plan, LoRA: peak {_f(g['plan_lora']['peak_gib'], 1)} GiB "
                  f"({'fits' if g['plan_lora']['fits'] else 'does not fit'}); the same run as full fine-tuning: peak "
                  f"{_f(g['plan_full']['peak_gib'], 1)} GiB ({'fits' if g['plan_full']['fits'] else 'does not fit'}).",
                  ""]
    elif g:
        lines += ["## GRPO steps", "", f"failed: {g.get('error')}", ""]
    a = res.get("actor") or {}
    if "lora" in a:
        lines += [f"## The actor's update alone ({ACTOR_ROWS} rows of {ACTOR_LEN} tokens, no vLLM, no reference)", "",
                  md_table(["", "trainable params", "weights GiB", "step 1 s", "step 2 s", "measured alloc GiB",
                            "planned alloc GiB", "status"],
                           [[k, _f(v.get("trainable_params")), _f(v.get("weights_gib"), 1), _f(v.get("step1_s")),
                             _f(v.get("step2_s")), _f(v.get("measured_allocated_gib"), 1),
                             _f(v.get("planned_allocated_gib"), 1), v.get("status")] for k, v in a.items()]), ""]
    elif a:
        lines += ["## The actor's update alone", "", f"failed: {a.get('error')}", ""]
    if res.get("peft"):
        lines += ["## Against PEFT (tiny Qwen3, fp32, on the GPU)", "", "```", json.dumps(res["peft"], indent=1),
                  "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_lora_out"))
    ap.add_argument("--only", nargs="*", default=["grpo", "actor"], choices=["grpo", "actor", "peft"])
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps (the first compiles kernels)")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.section:  # child process: one section, fresh GPU memory
        try:
            out = {"grpo": lambda: section_grpo(args.out, args.steps), "actor": section_actor,
                   "peft": lambda: section_peft(args.out)}[args.section]()
        except Exception as err:  # a failed section is a result; the other still runs
            out = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        with open(os.path.join(args.out, f"section_{args.section}.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
        return
    res = report_header("gpu_lora")
    for name in args.only:
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", args.out,
               "--steps", str(args.steps)]
        section = os.path.join(args.out, f"section_{name}.json")
        res[name], run = run_json_child(cmd, section, timeout_s={"grpo": 360, "actor": 120, "peft": 120}[name])
        if os.path.exists(section):
            os.remove(section)  # its content is in lora.json
        if res[name] is None:
            res[name] = {"error": f"section process exited with {run['rc']} (timed out: {run['timed_out']}) and "
                                  "wrote nothing"}
        res.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        print(f"[gpu_lora] {name}: {time.time() - t0:.0f} s", flush=True)
        write_report(args.out, "lora", res, to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
