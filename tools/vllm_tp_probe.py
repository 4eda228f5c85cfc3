"""vLLM tensor parallel on two GPUs without the trainer: does `VLLMEngine` with TP=2 (external launcher, the way
the colocated placement runs it) start, generate, sleep and wake, for a random Qwen3 of a given head_dim? Each rank
prints its progress; a rank still running after --stack-after seconds prints every thread's Python stack and exits.
Not a test (needs two GPUs and vLLM's CUDA build); issue 21's diagnosis of the colocated TP=2 hang.

    PYTHONPATH=/tmp/site python tools/vllm_tp_probe.py --head-dim 64    # starts in ~55 s, generates (H100 x2)
    PYTHONPATH=/tmp/site python tools/vllm_tp_probe.py --head-dim 16    # hung after the warm-up (2026-11-25)

--visible one: each process sees only its own GPU (CUDA_VISIBLE_DEVICES=rank, LOCAL_RANK=0), as Ray workers do;
--visible all: both GPUs visible, LOCAL_RANK=rank (torchrun style).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(rank: int, port: int, args: argparse.Namespace, path: str) -> None:
    local = rank if args.visible == "all" else 0
    if args.visible == "one":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(local), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    faulthandler.dump_traceback_later(args.stack_after, exit=True, file=sys.stderr)
    sys.path.insert(0, REPO)
    import torch
    import torch.distributed as dist

    import rltrain.rollout.vllm as vllm_engine
    from rltrain.rollout import SamplingParams
    from rltrain.utils.distenv import apply_no_multicast

    apply_no_multicast()
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t0 = time.time()

    def say(what: str) -> None:
        print(f"[rank {rank}, head_dim {args.head_dim}] {what} at {time.time() - t0:.1f} s", flush=True)

    say("world of 2 up")
    vllm_engine.tp_head_dim_error = lambda *a: None  # probe vLLM itself, not the rule that refuses small head dims
    eng = vllm_engine.VLLMEngine(path, device="cuda", dtype="bfloat16", seed=0, eos_token_id=2, tensor_parallel_size=2,
                     gpu_memory_utilization=0.3, enforce_eager=args.eager)
    say("engine started")
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=1, logprobs=True)
    out = eng.generate([[1, 5, 20]] * 8, sp)
    say(f"generated {sum(len(o.token_ids) for o in out)} tokens")
    eng.sleep(level=1)
    eng.wake_up()
    again = eng.generate([[1, 5, 20]] * 8, sp)
    say(f"slept, woke, generated again (same tokens: {[o.token_ids for o in out] == [o.token_ids for o in again]})")
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--visible", choices=["one", "all"], default="one")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="enforce_eager (default on)")
    ap.add_argument("--stack-after", type=float, default=110.0, help="seconds before a rank prints its stacks and exits")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if torch.cuda.device_count() < 2:
        sys.exit("vllm_tp_probe: needs two GPUs")
    path = f"/tmp/vllm_tp_probe_hd{args.head_dim}"
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=args.head_dim, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=2)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port, args, path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.stack_after + 30)
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    print(f"vllm_tp_probe: head_dim {args.head_dim}, exit codes {codes} ({'ok' if codes == [0, 0] else 'FAILED'})")
    sys.exit(0 if codes == [0, 0] else 1)


if __name__ == "__main__":
    main()
