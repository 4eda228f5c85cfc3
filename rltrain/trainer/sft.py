"""Supervised fine-tuning (the ReTool cold start) on multi-turn chat data through the Megatron engine.

Must not know RL: no rollouts, rewards or advantages; it writes an HF-format model the RL trainer starts from.

Loss: the masked mean of -log p(x_t | x_<t) over the step's assistant tokens (prompt and tool-output
tokens carry loss_mask 0; see rltrain/data/sft_data.py). The log-probs come from the same fused LM
head as RL (`trainer.fused_linear_logprob`): only loss_mask rows are computed and the [T, V]
logits are never built, so cross-entropy here IS -log-prob of the label. Micro-batches (token
budget `trainer.max_tokens_per_micro_batch`) are weighted by their token share, so the gradient is
that of the whole step's token mean, whatever the micro-batching and data-parallel split.

Checkpoints as the RL trainer's: every `trainer.save_freq` steps under `trainer.ckpt_dir` (utils/checkpoint.py:
atomic, with a manifest; each rank's engine state and RNG, the step and the data sampler), and `trainer.resume=auto`
(default) continues from the newest intact one, `never` starts over, a PATH continues from that checkpoint: a run
stopped by a deadline resumes on the loss curve it was on. The engine comes from models/builder.py.

One process per GPU: `python -m rltrain.sft --config-name retool_tiny_sft` (CPU), or
`torchrun --nproc_per_node=8 -m rltrain.sft --config-name sft_qwen3_4b` (data parallel x
`trainer.tensor_parallel_size`). The model is written to `trainer.output_dir` (default
<run dir>/hf) as config + safetensors + tokenizer: start RL from it with
`model.path=<dir> model.builtin=null model.tokenizer=<dir>`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from rltrain.config.convert import as_dict
from rltrain.config.schema import LogprobHeadConfig, ParallelConfig, SFTConfig
from rltrain.data.sft_data import SFTDataset, collate
from rltrain.models.hf_export import save_hf_checkpoint
from rltrain.models.loss_protocol import MicroBatch, ModelOutputs
from rltrain.utils.checkpoint import resume_path, save_checkpoint
from rltrain.utils.plain import load_plain, save_plain
from rltrain.utils.rundir import interrupted_line
from rltrain.utils.safefs import make_dirs, write_text
from rltrain.utils.seeding import rng_state, seed_all, set_rng_state
from rltrain.utils.timing import timer
from rltrain.utils.tracking import to_log_files


class SFTLoss:
    """loss_fn for the engine's train step (models/loss_protocol.LossFn): token mean of -log-prob over the
    micro-batch's extras["loss_mask"] [b, S].

    Also accumulates the summed NLL, entropy and token count of the step for exact logging.
    """

    needs_entropy_grad = False

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.nll = self.entropy = self.tokens = 0.0

    def __call__(self, outputs: ModelOutputs, mb: MicroBatch):
        lp = outputs.logprobs  # [b, S] fp32, 0 outside label_mask
        mask = mb.extras["loss_mask"].to(lp.device, torch.float32)  # [b, S]
        n = mask.sum()
        nll = -(lp * mask).sum()
        self.nll += float(nll.detach())
        self.tokens += float(n)
        ent = outputs.entropy
        if ent is not None:
            self.entropy += float((ent.detach() * mask).sum())
        return nll / n.clamp(min=1.0), {}


class SFTTrainer:
    def __init__(self, cfg: SFTConfig, run_dir: str):
        from rltrain.data.dataset import PromptSampler
        from rltrain.data.tokenizer import load_tokenizer
        from rltrain.workers.hybrid import initial_hf_model, resolve_device

        self.cfg, self.run_dir = cfg, run_dir
        m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.trainer
        self.seed = t.seed
        seed_all(self.seed)
        if os.environ.get("RLTRAIN_TORCH_THREADS"):
            torch.set_num_threads(max(1, int(os.environ["RLTRAIN_TORCH_THREADS"])))
        self.device = resolve_device(t.device)
        self.dtype = torch.float32 if self.device == "cpu" else getattr(torch, m.dtype)
        self.tokenizer = load_tokenizer(m.tokenizer or m.path, trust_remote_code=m.trust_remote_code)
        common = dict(tokenizer=self.tokenizer, max_length=d.max_length, messages_key=d.messages_key,
                      system_prompt=d.system_prompt)
        self.train_ds = SFTDataset(d.train_files, **common)
        self.val_ds = SFTDataset(d.val_files, **common) if d.val_files else None
        if d.batch_size > len(self.train_ds):
            from rltrain.data.dataset import DataError

            raise DataError(f"data.batch_size={d.batch_size} is larger than the {len(self.train_ds)} usable "
                            "training rows; lower data.batch_size or add data")
        steps_per_epoch = len(self.train_ds) // d.batch_size
        self.total_steps = int(t.total_steps or t.epochs * steps_per_epoch)

        from rltrain.models.builder import build_engine  # heavy: after the data, so bad data fails fast

        self.hf_config, hf_model = initial_hf_model(m, self.tokenizer, self.seed, self.dtype, self.device)
        state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
        del hf_model
        self.engine = build_engine(
            self.hf_config, role="actor", hf_state_dict=state, device=self.device, dtype=self.dtype, seed=self.seed,
            total_steps=self.total_steps, max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, optim=o,
            parallel=ParallelConfig(tensor_parallel_size=t.tensor_parallel_size), head=t.group(LogprobHeadConfig))
        del state
        self.dp_rank, self.dp_size = self.engine.data_parallel
        self.ckpt_dir = t.ckpt_dir or os.path.join(run_dir, "checkpoints")
        self.step = 0  # the last step run (the Ctrl-C line names it)
        self.is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.sampler = PromptSampler(self.train_ds, batch_size=d.batch_size, seed=self.seed, shuffle=d.shuffle)
        self.loss = SFTLoss()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.tracker = None  # rank 0's, made in fit once the step the run continues after is known

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        t = self.cfg.trainer
        bar = None
        last: dict = {}
        start = self._maybe_resume()
        if self.is_rank0:  # a resume in the same run directory continues its metrics.jsonl and wandb run
            from rltrain.utils.tracking import Tracker

            self.tracker = Tracker(t.logger, self.run_dir, project=t.project_name, experiment=t.experiment_name,
                                   config=as_dict(self.cfg), start_step=start)
        if t.progress_bar and self.is_rank0:
            from rltrain.utils.tracking import progress_bar

            bar = progress_bar(self.total_steps, start, "rltrain sft")
        try:
            for step in range(start + 1, self.total_steps + 1):
                self.step = step
                m: dict = {}
                with timer("step", m):
                    rows = self.sampler.next_batch()[self.dp_rank::self.dp_size]
                    m.update(self.train_step(collate(rows, self.pad_id)))
                if not math.isfinite(m["sft/loss"]):
                    raise FloatingPointError(f"sft/loss is {m['sft/loss']} at step {step}; lower optim.lr")
                if self.val_ds is not None and ((t.test_freq > 0 and step % t.test_freq == 0)
                                                or step == self.total_steps):
                    m["sft/val_loss"] = self.validate()
                m["training/global_step"] = step
                m["sft/epoch"] = self.sampler.epoch
                if self.tracker is not None:
                    self.tracker.log(m, step=step)
                last.update(m)
                if t.save_freq > 0 and step % t.save_freq == 0:
                    self.save(step)
                if bar is not None:
                    bar.set_postfix(loss=f"{m['sft/loss']:.4f}", step_s=f"{m['timing_s/step']:.2f}")
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            if self.tracker is not None:
                self.tracker.finish()
        last["output_dir"] = self.export(t.output_dir or os.path.join(self.run_dir, "hf"))
        return last

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this rank's rows: input_ids [b, S], loss_mask [b, S], seq_lens [b]."""
        mask = batch["loss_mask"]
        tensors = {"input_ids": batch["input_ids"], "label_mask": mask.bool(), "loss_mask": mask}
        mbs = self.engine.make_micro_batches(tensors, batch["seq_lens"])
        total = self.engine.data_parallel_sum([float(mask.sum())])[0]
        for mb in mbs:  # token share of the global step; x dp_size because the engine averages over ranks
            mb.loss_scale = float(mb.extras["loss_mask"].sum()) / max(total, 1.0) * self.dp_size
        self.loss.reset()
        out = self.engine.train_step(mbs, self.loss, temperature=1.0)  # SFT: the model's own distribution
        nll, ent, tokens = self.engine.data_parallel_sum([self.loss.nll, self.loss.entropy, self.loss.tokens])
        return {"sft/loss": nll / max(tokens, 1.0), "sft/entropy": ent / max(tokens, 1.0),
                "sft/grad_norm": float(out["grad_norm"]), "sft/lr": float(out["lr"]), "sft/tokens": tokens}

    @torch.no_grad()
    def validate(self) -> float:
        """Token-mean NLL of the assistant tokens of data.val_files (this rank's share, summed over ranks)."""
        nll = tokens = 0.0
        items = [self.val_ds[i] for i in range(self.dp_rank, len(self.val_ds), self.dp_size)]
        bs = self.cfg.data.batch_size
        for lo in range(0, len(items), bs):
            b = collate(items[lo:lo + bs], self.pad_id)
            lp, _ = self.engine.forward_logprobs(b["input_ids"], b["seq_lens"], b["loss_mask"].bool(),
                                                 with_entropy=False)
            nll -= float((lp * b["loss_mask"]).sum())
            tokens += float(b["loss_mask"].sum())
        nll, tokens = self.engine.data_parallel_sum([nll, tokens])
        return nll / max(tokens, 1.0)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str | None:
        """A checkpoint of `step` under trainer.ckpt_dir (utils/checkpoint.py: atomic, with a manifest): each rank's
        engine shard and RNG in rank<r>.pt, the step and the sampler in trainer_state.pt. Every rank must call."""
        def write(tmp: str | None) -> None:
            tmp = _from_rank0(tmp)  # rank 0 fills its temp dir; the other ranks write into it
            save_plain({"engine": self.engine.state_dict(), "rng": rng_state()}, os.path.join(tmp, f"rank{_rank()}.pt"))
            _barrier()
            if self.is_rank0:
                save_plain({"step": step, "sampler": self.sampler.state_dict()}, os.path.join(tmp, "trainer_state.pt"))

        path = None
        if self.is_rank0:
            path = save_checkpoint(self.ckpt_dir, step, write, max_to_keep=self.cfg.trainer.max_ckpt_to_keep)
            print(f"rltrain sft: saved checkpoint {path}", file=sys.stderr, flush=True)
        else:
            write(None)
        _barrier()
        return path

    def _maybe_resume(self) -> int:
        """trainer.resume: auto (the newest intact checkpoint under trainer.ckpt_dir, if any), never, or a PATH.
        Returns the step to continue after (0: from the start)."""
        path = resume_path(self.cfg.trainer.resume, self.ckpt_dir, upto=self.run_dir)
        if path is None:
            return 0
        state = load_plain(os.path.join(path, "trainer_state.pt"))  # data only (utils/plain.py)
        shard = load_plain(os.path.join(path, f"rank{_rank()}.pt"))
        self.engine.load_state_dict(shard["engine"])
        set_rng_state(shard["rng"])
        self.sampler.load_state_dict(state["sampler"])
        if self.is_rank0:
            print(f"rltrain sft: resumed from {path} (step {state['step']})", file=sys.stderr, flush=True)
        return int(state["step"])

    # ------------------------------------------------------------------ output
    def export(self, out_dir: str) -> str:
        """Write the model as a transformers checkpoint (config + safetensors + tokenizer), atomically:
        into `<out_dir>.tmp`, then renamed. Every rank must call (TP gathers); rank 0 writes."""
        named = dict(self.engine.export_hf_weights(1 << 30))
        out_dir = os.path.abspath(out_dir)
        if self.is_rank0:
            save_hf_checkpoint(out_dir, self.hf_config, named, tokenizer=self.tokenizer, dtype=self.dtype, atomic=True)
            print(f"rltrain sft: wrote the HF model to {out_dir}", file=sys.stderr, flush=True)
        _barrier()
        return out_dir


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(value):
    """Rank 0's `value` on every rank (a picklable object; itself without torch.distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_sft_from_config(cfg: SFTConfig, run_dir: str | None = None) -> dict:
    """Build the SFT trainer from a typed SFTConfig (the entry point converted it) and run it; returns the last
    step's metrics plus "output_dir" (the HF model)."""
    from rltrain.trainer.setup import run_directory

    run_dir = run_dir or run_directory()
    make_dirs(run_dir)
    if os.environ.get("RANK", "0") == "0":  # torchrun: one writer
        write_text(os.path.join(run_dir, "config.json"), json.dumps(as_dict(cfg), indent=1))
    start = time.time()
    trainer = SFTTrainer(cfg, run_dir)
    try:
        last = trainer.fit()
    except KeyboardInterrupt:  # Ctrl-C: one line from rank 0, no traceback
        if trainer.is_rank0:
            line = interrupted_line(trainer.step, trainer.ckpt_dir, run_dir)
            print(line, file=sys.stderr, flush=True)
            to_log_files(line)
        raise SystemExit(130) from None
    if trainer.is_rank0:
        print(f"rltrain sft: finished {trainer.total_steps} steps in {time.time() - start:.0f} s "
              f"(loss {last.get('sft/loss', float('nan')):.4f}); model: {last['output_dir']}", flush=True)
    return last
