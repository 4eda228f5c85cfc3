"""The PPO/GRPO driver loop: rollout -> reward -> log-probs -> advantages -> update -> sync -> log -> save.

Runs on the driver; composes worker groups (workers/) and pure math (algorithms/). Each phase is timed as
`timing_s/<phase>`. Entry point: `python -m rltrain.main --config-name grpo_tiny` (see rltrain/main.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from rltrain.algorithms import (
    compute_advantages,
    filter_informative_groups,
    kl_penalty,
    overlong_penalty,
    policy_mismatch,
    truncated_is_weights,
)
from rltrain.config.convert import as_config
from rltrain.config.schema import TISConfig, TrainerConfig
from rltrain.data.batch import Batch
from rltrain.trainer.async_rollout import AsyncRollout
from rltrain.trainer.setup import build_datasets, build_workers, check_model, config_dict, run_directory
from rltrain.utils.checkpoint import find_latest_valid, loading_checkpoint, save_checkpoint, verify_checkpoint
from rltrain.utils.memory import memory_metrics
from rltrain.utils.timing import timer
from rltrain.utils.tracking import Tracker
from rltrain.workers.group import WorkerLost, gather_rows, init_ray, mean_metrics, run_together


class TrainingDiverged(FloatingPointError):
    """A NaN/inf loss or gradient: the run stops and the last good checkpoint is kept."""


def _stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    v = x[mask.bool()] if mask is not None else x.flatten()
    if v.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": v.float().mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


class PPOTrainer:
    def __init__(self, cfg, run_dir: str):
        cfg = as_config(cfg)  # an RLConfig (tests and tools may hand a dict of one)
        self.cfg, self.run_dir = cfg, run_dir
        t = cfg.trainer
        self.seed = t.seed
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        self.ckpt_dir = t.ckpt_dir or os.path.join(run_dir, "checkpoints")
        self.tokenizer, self.train_ds, self.val_ds, self.sampler, self.reward = build_datasets(cfg)
        check_model(cfg, self.tokenizer)  # a missing model path fails here, before any worker starts
        if t.use_ray:
            init_ray(t.ray_address, t.num_cpus)
        self.use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        self.train_group, self.rollout_group = build_workers(cfg, use_ref=self.use_ref, use_critic=self.use_critic,
                                                             ckpt_dir=self.ckpt_dir if t.use_ray else None)
        self.colocated = self.rollout_group is self.train_group
        self._sync_ready = False  # split: the weight-sync group is built at the first sync
        self.tracker = Tracker(t.logger, run_dir, project=t.project_name, experiment=t.experiment_name,
                               config=config_dict(cfg))
        self.global_step = 0
        self.next_group_id = 0
        self.async_rollout = None  # trainer.async_rollout: the next batch generates while this one trains
        if t.async_rollout:
            self.async_rollout = AsyncRollout(self, max_staleness=t.max_staleness, total_steps=t.total_steps,
                                              refills=cfg.algorithm.dynamic_sampling.enable)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        t = self.cfg.trainer
        self.global_step = self._maybe_resume()
        last: dict = {}
        if t.val_before_train and self.global_step == 0 and t.test_freq > 0:
            val = self.validate()
            self.tracker.log(val, step=0)
            last.update(val)
        bar = _progress(t, self.global_step)
        completed = False
        try:
            while self.global_step < t.total_steps:
                self.global_step += 1
                step = self.global_step
                metrics = self.train_step(step)
                if t.test_freq > 0 and (step % t.test_freq == 0 or step == t.total_steps):
                    with timer("validation", metrics):  # async: includes waiting for the batch in flight
                        metrics.update(self.validate())
                metrics["training/global_step"] = step
                self.tracker.log(metrics, step=step)
                last.update(metrics)
                if t.save_freq > 0 and step % t.save_freq == 0:
                    self.save(step)
                _fault_injection(step)
                if bar is not None:
                    bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}",
                                    step_s=f"{metrics['timing_s/step']:.1f}")
                    bar.update(1)
            completed = True
        finally:
            if bar is not None:
                bar.close()
            self._finish(export=completed)
        return last

    def train_step(self, step: int) -> dict:
        cfg, a = self.cfg, self.cfg.actor
        m: dict = {}
        temperature = cfg.rollout.temperature or 1.0
        with timer("step", m):
            if self.async_rollout is not None:
                self.async_rollout.boundary(step, m)  # wait for this step's batch, push weights, submit the next
            with timer("gen", m):
                batch, gen_metrics = self._rollout_with_rewards(step, m)
            m.update(gen_metrics)
            if self.colocated:
                with timer("rollout_sleep", m):
                    self.train_group.run("rollout_sleep")

            with timer("old_log_prob", m):
                old, ent = gather_rows(self.train_group.run_split("compute_old_logprobs", batch, temperature), batch)
            batch = batch.replace(old_logprobs=old)
            m["actor/entropy_rollout"] = _masked_mean(ent, batch.loss_mask)
            m.update(_mismatch_metrics(batch, a.tis))
            if self.use_ref:
                with timer("ref", m):
                    ref = gather_rows(self.train_group.run_split("compute_ref_logprobs", batch, temperature), batch)
                batch = batch.replace(ref_logprobs=ref)
            if self.use_critic:
                with timer("values", m):
                    values = gather_rows(self.train_group.run_split("compute_values", batch), batch)
                batch = batch.replace(values=values)

            with timer("adv", m):
                batch = self._advantages(batch, m)

            mini_rows = a.ppo_mini_batch_size * cfg.rollout.n // self.train_group.dp_size
            if self.use_critic:
                with timer("update_critic", m), _diverged_as_error(step, self.ckpt_dir):
                    res = self.train_group.run_split("update_critic", batch, max(1, mini_rows),
                                                     cfg.critic.ppo_epochs, self.seed + step)
                m.update(mean_metrics(res))
            with timer("update_actor", m), _diverged_as_error(step, self.ckpt_dir):
                res = self.train_group.run_split("update_actor", batch, max(1, mini_rows), a.ppo_epochs,
                                                 temperature, self.seed + step)
            m.update(mean_metrics(res))

            if self.async_rollout is None:  # async: pushed at the next step's boundary
                with timer("update_weights", m):  # colocated: includes the engine's wake-up (timed alone too)
                    self._sync_weights(m)

        n_tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
        m["perf/total_num_tokens"] = n_tokens
        m["perf/throughput"] = n_tokens / max(m["timing_s/step"], 1e-9)
        m["timing_s/reward"] = m.get("timing_s/reward", 0.0)
        m.update(memory_metrics())
        for group in {id(self.train_group): self.train_group, id(self.rollout_group): self.rollout_group}.values():
            m.update(group.memory_metrics())  # per GPU under Ray
        return m

    # ------------------------------------------------------------------ phases
    def _rollout_with_rewards(self, step: int, m: dict) -> tuple[Batch, dict]:
        """Sample n responses per prompt and score them; with DAPO dynamic sampling, keep only groups
        whose scores differ and refill (bounded tries) until the batch holds train_batch_size groups."""
        cfg = self.cfg
        ds = cfg.algorithm.dynamic_sampling
        want = cfg.data.train_batch_size
        kept: list[Batch] = []
        n_groups, tries, dropped_total = 0, 0, 0
        gen_metrics: dict = {}
        while True:
            tries += 1
            if tries == 1 and self.async_rollout is not None:
                batch, gm = self.async_rollout.take()  # generated while the previous step trained
            else:
                batch, gm = self._generate(self.sampler.next_batch(), validate=False,
                                           seed=self._rollout_seed(step, tries))
            gen_metrics = gm if not gen_metrics else gen_metrics
            with timer("reward", m):
                batch, rm = self._score(batch)
            gen_metrics.update(rm)
            if not ds.enable:
                kept.append(batch)
                break
            keep, dropped = filter_informative_groups(batch.scores, batch.group_ids)
            dropped_total += dropped
            if keep.any():
                kept.append(batch.select(keep))
                n_groups += int(torch.unique(batch.group_ids[keep]).numel())
            if n_groups >= want or tries >= ds.max_tries:
                break
        if self.async_rollout is not None:
            self.async_rollout.submit(step + 1)  # after the refills (no-op if already in flight)
        batch = Batch.concat(kept) if len(kept) > 1 else kept[0]
        if ds.enable:
            if len(batch) == 0 or n_groups == 0:
                raise RuntimeError("dynamic sampling found no group with differing scores in "
                                   f"{tries} tries; raise algorithm.dynamic_sampling.max_tries or disable it")
            gen_metrics["dynamic_sampling/dropped_groups"] = dropped_total
            gen_metrics["dynamic_sampling/tries"] = tries
        gen_metrics.update(_stats("critic/score", batch.scores))
        lengths = batch.response_mask.sum(-1).float()
        max_len = cfg.rollout.max_response_length
        gen_metrics.update(_stats("response_length", lengths))
        gen_metrics["response_length/clip_ratio"] = (lengths >= max_len).float().mean().item()
        gen_metrics.update(_stats("prompt_length", batch.prompt_mask.sum(-1).float()))
        if cfg.rollout.multi_turn.enable:
            gen_metrics["num_turns/mean"] = float(np.mean(batch.non_tensor["num_turns"]))
            gen_metrics["tool_call_counts/mean"] = float(np.mean(batch.non_tensor["tool_calls"]))
        return batch, gen_metrics

    def _rollout_seed(self, step: int, tries: int) -> int:
        return self.seed * 100_003 + step * 101 + tries

    def _generate(self, prompts: list[dict], *, validate: bool, seed: int) -> tuple[Batch, dict]:
        return self._collect_generate(self._submit_generate(prompts, validate=validate, seed=seed))

    def _submit_generate(self, prompts: list[dict], *, validate: bool, seed: int):
        """Start sampling `prompts` on the rollout group without waiting; `_collect_generate` gives the result."""
        g = self.rollout_group
        per = math.ceil(len(prompts) / g.num_replicas)
        args = []
        for k in range(g.num_replicas):
            shard = prompts[k * per:(k + 1) * per]
            args.append((shard, self.next_group_id + k * per, validate, seed + k))
        self.next_group_id += len(prompts)
        return g.submit_per_replica("generate", args), [bool(a[0]) for a in args]

    def _collect_generate(self, submitted) -> tuple[Batch, dict]:
        handle, nonempty = submitted
        outs = [o for o, keep in zip(self.rollout_group.wait(handle), nonempty) if keep]
        batch = Batch.concat([o[0] for o in outs])
        metrics = mean_metrics([o[1] for o in outs])
        return batch, metrics

    def _score(self, batch: Batch) -> tuple[Batch, dict]:
        from rltrain.rewards import compute_rewards

        r = self.cfg.reward
        vocab = getattr(self.tokenizer, "vocab_size", None) or len(self.tokenizer)
        unk = getattr(self.tokenizer, "unk_token_id", None) or 0
        # a model whose vocab is larger than its tokenizer's (e.g. Qwen3 shapes + the char tokenizer) may
        # sample ids the tokenizer cannot decode: they read as <unk>
        ids = torch.where(batch.response_ids < vocab, batch.response_ids, torch.full_like(batch.response_ids, unk))
        texts = self.tokenizer.batch_decode(
            [row[:n].tolist() for row, n in zip(ids, batch.response_mask.sum(-1))], skip_special_tokens=True)
        extras = batch.non_tensor["extra"]
        if self.cfg.rollout.multi_turn.enable:
            # tool use for the reward (rewards/retool.py): num_turns counted as chat messages, i.e. user +
            # assistant = 2 plus a call and a result per executed tool call; tool_calls as executed
            extras = [{**e, "num_turns": 2 + 2 * int(tc), "tool_calls": int(tc)}
                      for e, tc in zip(extras, batch.non_tensor["tool_calls"])]
        scores, rm = compute_rewards(self.reward, texts, batch.non_tensor["ground_truth"],
                                     data_sources=batch.non_tensor["data_source"], extras=extras,
                                     timeout_s=r.timeout_s, max_workers=r.max_workers)
        scores_t = torch.tensor(scores, dtype=torch.float32)
        al = self.cfg.algorithm
        metrics = {k if "/" in k else f"reward/{k}": v for k, v in rm.items()}
        if al.overlong.enable:
            pen = overlong_penalty(batch.response_mask.sum(-1), self.cfg.rollout.max_response_length,
                                   al.overlong.buffer_len, al.overlong.penalty_factor)
            metrics["reward/overlong_penalty_mean"] = pen.float().mean().item()
            scores_t = scores_t + pen
        return batch.replace(scores=scores_t), metrics

    def _advantages(self, batch: Batch, m: dict) -> Batch:
        al = self.cfg.algorithm
        mask = batch.response_mask.float()
        last = (batch.response_mask.sum(-1) - 1).clamp(min=0)
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(batch)), last] = batch.scores
        token_rewards = token_rewards * mask
        if al.use_kl_in_reward:
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, al.kl_penalty) * batch.loss_mask
            token_rewards = token_rewards - al.kl_coef * kl
            m["critic/kl"] = _masked_mean(kl, batch.loss_mask)
        loss_mask = batch.loss_mask
        if al.mask_truncated_responses:
            from rltrain.algorithms import truncated_response_mask

            truncated = torch.tensor([f == "length" for f in batch.non_tensor["finish_reason"]])
            loss_mask = truncated_response_mask(loss_mask, truncated)
        adv, ret = compute_advantages(al.adv_estimator, token_rewards, batch.response_mask,
                                      group_ids=batch.group_ids, values=batch.values, gamma=al.gamma,
                                      lam=al.lam, norm_by_std=al.norm_adv_by_std_in_grpo)
        batch = batch.replace(token_rewards=token_rewards, advantages=adv * mask, returns=ret * mask,
                              loss_mask=loss_mask)
        m.update(_stats("critic/rewards", token_rewards.sum(-1)))
        m.update(_stats("critic/advantages", adv, batch.response_mask))
        m.update(_stats("critic/returns", ret, batch.response_mask))
        if batch.values is not None:
            m.update(_stats("critic/values", batch.values, batch.response_mask))
        return batch

    def _sync_weights(self, metrics: dict | None = None) -> None:
        bucket = self.cfg.rollout.weight_sync_bucket_mb << 20
        if self.colocated:
            with timer("rollout_wake", {} if metrics is None else metrics):
                self.train_group.run("rollout_wake_up")
            self.train_group.run("sync_weights_local", bucket)
        else:  # split: train rank 0 streams buckets to the rollout group (rollout/weight_sync.py)
            if not self._sync_ready:
                host, port, nccl_port = self.train_group.run_rank0("weight_sync_address")
                ranks = self.rollout_group.world_size
                run_together((self.train_group, "weight_sync_init", (host, port, nccl_port, ranks)),
                             (self.rollout_group, "weight_sync_init", (host, port, nccl_port, ranks)))
                self._sync_ready = True
            run_together((self.train_group, "send_weights", (bucket,)), (self.rollout_group, "receive_weights", ()))

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict:
        if self.val_ds is None:
            return {}
        if self.async_rollout is not None:
            self.async_rollout.before_validation(self.global_step)  # sample with the current weights
        bs = self.cfg.data.val_batch_size
        items = [self.val_ds[i] for i in range(len(self.val_ds))]
        scores, sources = [], []
        reward_sums: dict[str, float] = {}  # a dict reward's extra numbers (e.g. tool use), summed over rows
        for lo in range(0, len(items), bs):
            chunk = items[lo:lo + bs]
            batch, _ = self._generate(chunk, validate=True, seed=self.seed)
            batch, rm = self._score(batch)
            scores += batch.scores.tolist()
            sources += [s or "default" for s in batch.non_tensor["data_source"]]
            for k, v in rm.items():
                if k.endswith("/mean"):
                    reward_sums[k] = reward_sums.get(k, 0.0) + v * len(batch)
        out = {}
        for src in sorted(set(sources)):
            vals = [s for s, d in zip(scores, sources) if d == src]
            out[f"val/{src}/accuracy"] = float(np.mean([v > 0 for v in vals]))
            out[f"val/{src}/score"] = float(np.mean(vals))
        out["val/accuracy"] = float(np.mean([v > 0 for v in scores]))
        out.update({f"val/{k}": v / len(scores) for k, v in reward_sums.items()})  # e.g. val/reward/tool_call/mean
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        def write(tmp: str) -> None:
            self.train_group.run("save", tmp)
            state = {"step": step, "next_group_id": self.next_group_id, "sampler": self.sampler.state_dict(),
                     "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "python": random.getstate()}}
            if self.async_rollout is not None:
                state.update(self.async_rollout.state_dict())  # the batch in flight is saved, not lost
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))

        path = save_checkpoint(self.ckpt_dir, step, write, max_to_keep=self.cfg.trainer.max_ckpt_to_keep)
        print(f"rltrain: saved checkpoint {path}", file=sys.stderr, flush=True)
        return path

    def _maybe_resume(self) -> int:
        mode = self.cfg.trainer.resume
        if mode == "never":
            return 0
        if mode == "auto":
            found = find_latest_valid(self.ckpt_dir)
            if found is None:
                return 0
            path = found[1]
        else:
            reason = verify_checkpoint(mode)
            if reason is not None:
                raise ValueError(f"trainer.resume={mode!r} is not a usable checkpoint: {reason}")
            path = mode
        with loading_checkpoint(path):  # another model shape, an unreadable file: message + exit 2
            state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
            self.train_group.run("load", path, self.cfg.rollout.weight_sync_bucket_mb << 20)
        if not self.colocated:
            self._sync_weights()
        self.sampler.load_state_dict(state["sampler"])
        self.next_group_id = state["next_group_id"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        if self.async_rollout is not None:
            self.async_rollout.load_state_dict(state, int(state["step"]))
        print(f"rltrain: resumed from {path} (step {state['step']})", file=sys.stderr, flush=True)
        return int(state["step"])

    def _finish(self, export: bool = True) -> None:
        t = self.cfg.trainer
        if export and t.export_hf_on_end and self.global_step > 0:
            out = os.path.join(self.run_dir, "hf")
            self.train_group.run("export_hf", out)
            print(f"rltrain: exported the actor in transformers format to {out}", file=sys.stderr, flush=True)
        self.tracker.finish()
        for group in {id(self.train_group): self.train_group, id(self.rollout_group): self.rollout_group}.values():
            group.shutdown()
        if t.plots and os.path.exists(os.path.join(self.run_dir, "metrics.jsonl")):
            from rltrain.utils.plotting import plot_run

            plot_run(self.run_dir)


@contextmanager
def _diverged_as_error(step: int, ckpt_dir: str):
    """Turn a worker's FloatingPointError (NaN/inf loss or grad norm) into a clear TrainingDiverged."""
    try:
        yield
    except Exception as err:  # Ray wraps worker exceptions in RayTaskError(<original type>)
        if isinstance(err, FloatingPointError) or "FloatingPointError" in type(err).__name__ + str(err)[:2000]:
            first = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
            raise TrainingDiverged(
                f"training diverged at step {step} ({first}). The run stops here without saving; the last "
                f"good checkpoint under {ckpt_dir} is kept (lower actor.lr or check the data/reward)") from None
        raise


def _fault_injection(step: int) -> None:
    """Test hook: RLTRAIN_FAULT_KILL_AFTER_STEP=N SIGKILLs this process right after step N (crash tests)."""
    if os.environ.get("RLTRAIN_FAULT_KILL_AFTER_STEP") == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _mismatch_metrics(batch: Batch, tis: TISConfig) -> dict[str, float]:
    """Training/inference mismatch of the sampled tokens (sampler vs recomputed old log-probs) and, with
    actor.tis enabled, the importance weights the loss applies."""
    mm = policy_mismatch(batch.old_logprobs, batch.sampler_logprobs, batch.loss_mask)
    out = {"rollout/mismatch_abs_mean": float(mm["abs_mean"]), "rollout/mismatch_kl": float(mm["kl"]),
           "rollout/logprob_diff_max": float(mm["abs_max"])}
    if tis.enable:
        _, st = truncated_is_weights(batch.old_logprobs, batch.sampler_logprobs, batch.loss_mask, cap=tis.cap,
                                     mode=tis.mode)
        out.update({"rollout/is_weight_mean": float(st["weight_mean"]), "rollout/is_ratio_max": float(st["ratio_max"]),
                    "rollout/is_clipfrac": float(st["clipfrac"])})
    return out


def _masked_mean(x: torch.Tensor | None, mask: torch.Tensor) -> float:
    if x is None:
        return float("nan")
    m = mask.float()
    return float((x * m).sum() / m.sum().clamp(min=1))


def _progress(t: TrainerConfig, start: int):
    if not t.progress_bar:
        return None
    from tqdm import tqdm

    return tqdm(total=t.total_steps, initial=start, desc="rltrain", unit="step", file=sys.stderr,
                dynamic_ncols=True, leave=True, disable=None)  # no bar when stderr is not a terminal


def run_from_config(cfg, run_dir: str | None = None) -> dict:
    """Build the trainer from a composed Hydra config and run it; returns the last step's metrics."""
    cfg = as_config(cfg)  # the one conversion: typed objects from here on
    run_dir = run_dir or run_directory()
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config_dict(cfg), f, indent=1)
    start = time.time()
    trainer = PPOTrainer(cfg, run_dir)
    try:
        last = trainer.fit()
    except TrainingDiverged as err:
        print(f"rltrain: {err}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    except WorkerLost as err:
        found = find_latest_valid(trainer.ckpt_dir, log=lambda msg: None)
        last = f"the last good checkpoint is {found[1]} (step {found[0]})" if found else \
            f"there is no checkpoint under {trainer.ckpt_dir} yet (trainer.save_freq)"
        print(f"rltrain: {err}. The run stops; {last}. Rerun the same command with trainer.resume=auto to "
              "continue from it.", file=sys.stderr, flush=True)
        raise SystemExit(4) from None
    print(f"rltrain: finished {cfg.trainer.total_steps} steps in {time.time() - start:.0f} s; "
          f"run directory: {run_dir}", flush=True)
    return last
