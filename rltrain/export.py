"""Export the actor of an rltrain checkpoint as a transformers model directory (config + safetensors + tokenizer).

  python -m rltrain.export RUN_DIR/checkpoints/step_20 OUT_DIR [--config RUN_DIR/config.json] [--merged]

A LoRA run (actor.lora.rank > 0) is exported as a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors: `peft.PeftModel.from_pretrained(base, OUT_DIR)` or vLLM's LoRARequest load it onto
model.path); --merged also writes the merged model (W + alpha / r B A) as a transformers checkpoint in OUT_DIR/merged.

The run's resolved config (written by rltrain.main as RUN_DIR/config.json) says how to build the model; the
export runs on CPU in this process (tensor-parallel checkpoints need the same number of processes: use
`trainer.export_hf_on_end=true` in the run instead). A checkpoint or config that cannot be used: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _refuse(message: str) -> int:
    print(f"rltrain.export: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rltrain.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--config", help="the run's config.json (default: CHECKPOINT/../../config.json)")
    ap.add_argument("--merged", action="store_true", help="LoRA runs: also write the merged model to OUT_DIR/merged")
    args = ap.parse_args(argv)

    from rltrain.config import as_config
    from rltrain.utils.checkpoint import verify_checkpoint
    from rltrain.workers.hybrid import HybridWorker

    reason = verify_checkpoint(args.checkpoint)
    if reason is not None:
        return _refuse(f"{args.checkpoint} is not a usable checkpoint: {reason}")
    cfg_path = args.config or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.checkpoint))),
                                           "config.json")
    if not os.path.isfile(cfg_path):
        return _refuse(f"config {cfg_path} not found; pass --config RUN_DIR/config.json")
    with open(cfg_path) as f:
        cfg = as_config(json.load(f))  # the run's config.json, typed once
    if cfg.actor.tensor_parallel_size != 1 or cfg.actor.pipeline_parallel_size != 1:
        return _refuse("this checkpoint is tensor- or pipeline-parallel; export it from the run with "
                       "trainer.export_hf_on_end=true")
    cfg.trainer.device = "cpu"
    worker = HybridWorker(cfg, ["actor"])
    worker.setup("127.0.0.1", worker.address()[1])
    worker.load(args.checkpoint, bucket_bytes=1 << 28)
    print(worker.export_hf(args.out_dir, merged=args.merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
