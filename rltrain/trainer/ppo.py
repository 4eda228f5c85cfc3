"""The PPO/GRPO driver loop: rollout -> reward -> log-probs -> advantages -> update -> sync -> log -> save.

Runs on the driver; composes worker groups (workers/), the rollout source that makes each step's scored batch
(trainer/rollout_source.py), the weight push (trainer/weight_sync.py) and pure math (algorithms/). Each phase is
timed as `timing_s/<phase>`. Entry point: `python -m rltrain.main --config-name grpo_tiny` (see rltrain/main.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch

from rltrain.algorithms import (compute_advantages, distill_advantages, kl_penalty, off_policy_weights, overlong_penalty,
                                policy_mismatch)
from rltrain.config.convert import as_dict
from rltrain.config.schema import OffPolicyConfig, RLConfig, TrainerConfig
from rltrain.data.batch import Batch
from rltrain.rewards.scoring import score_batch
from rltrain.trainer.async_rollout import AsyncRollout
from rltrain.trainer.rollout_source import RolloutSource, stats
from rltrain.trainer.setup import (build_datasets, build_workers, check_config, check_model, plan_check, plan_metrics,
                                   run_directory)
from rltrain.trainer.weight_sync import WeightSync
from rltrain.utils.checkpoint import (TRAINER_STATE, loading_checkpoint, read_trainer_state, resume_path,
                                     save_checkpoint)
from rltrain.utils.memory import memory_metrics
from rltrain.utils.plain import save_plain
from rltrain.utils.safefs import make_dirs, write_text
from rltrain.utils.seeding import rng_state, seed_all, set_rng_state
from rltrain.utils.timing import timer
from rltrain.utils.rundir import interrupted_line, last_checkpoint
from rltrain.utils.tracking import Tracker, to_log_files
from rltrain.workers.group import WorkerLost, gather_rows, init_ray, mean_metrics


class TrainingDiverged(FloatingPointError):
    """A NaN/inf loss or gradient: the run stops and the last good checkpoint is kept."""


class PPOTrainer:
    """after_step(step): called right after step `step` is logged and saved (tests install their crash hooks here;
    the trainer reads no test switch itself)."""

    def __init__(self, cfg: RLConfig, run_dir: str, *, after_step: Callable[[int], None] | None = None):
        self.cfg, self.run_dir, self.after_step = cfg, run_dir, after_step
        t = cfg.trainer
        self.seed = t.seed
        seed_all(self.seed)
        self.ckpt_dir = t.ckpt_dir or os.path.join(run_dir, "checkpoints")
        check_config(cfg)  # config/'s rules and the rooms' (placement, engines), before any data or tokenizer work
        self.tokenizer, self.train_ds, self.val_ds, sampler, self.reward = build_datasets(cfg)
        # on GPUs (trainer.plan_check), at the data's prompt lengths: a GPU the plan says will not fit stops here
        self.plan = plan_check(cfg, dataset=self.train_ds)
        check_model(cfg, self.tokenizer)  # a missing model path fails here, before any worker starts
        if t.use_ray:
            init_ray(t.ray_address, t.num_cpus)
        self.use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        # teacher_group: the group whose workers hold the distillation teacher (teacher.*), or None
        self.train_group, self.rollout_group, self.teacher_group = build_workers(
            cfg, use_ref=self.use_ref, use_critic=self.use_critic, ckpt_dir=self.ckpt_dir if t.use_ray else None)
        self.colocated = self.rollout_group is self.train_group
        # rollout.free_cache_engine=false: a colocated engine stays awake through the step (no sleep, no wake-up)
        self.sleeps = self.colocated and cfg.rollout.free_cache_engine
        self.weight_sync = WeightSync(self.train_group, self.rollout_group,
                                      bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20, wake_up=self.sleeps)
        self.tracker: Tracker | None = None  # made in fit, once the step the run continues after is known
        self.global_step = 0
        self.rollout = RolloutSource(self.rollout_group, sampler, seed=self.seed, score=self._score,
                                     want_groups=cfg.data.train_batch_size,
                                     dynamic_sampling=cfg.algorithm.dynamic_sampling,
                                     max_response_length=cfg.rollout.max_response_length,
                                     multi_turn=cfg.rollout.multi_turn.enable, partial=cfg.rollout.partial)
        if t.async_rollout:  # the next batch generates while this one trains
            self.rollout.use_pipeline(AsyncRollout(self.rollout, self.weight_sync.push, max_staleness=t.max_staleness,
                                                   total_steps=t.total_steps,
                                                   refills=cfg.algorithm.dynamic_sampling.enable,
                                                   idle_probe=self.rollout_group.memory_metrics))

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        t = self.cfg.trainer
        last: dict = {}
        bar, completed = None, False
        try:  # whatever fails (resume included), the workers are shut down
            self.global_step = self._maybe_resume()
            # a resume in the same run directory continues its metrics.jsonl and wandb run (utils/tracking.py)
            self.tracker = Tracker(t.logger, self.run_dir, project=t.project_name, experiment=t.experiment_name,
                                   config=as_dict(self.cfg), start_step=self.global_step)
            if self.global_step == 0 and self.cfg.model.init == "engine":
                self.weight_sync.push()  # the engine started from dummy weights: the actor's own before generating
            if t.val_before_train and self.global_step == 0 and t.test_freq > 0:
                val = self.validate()
                self.tracker.log(val, step=0)
                last.update(val)
            bar = _progress(t, self.global_step)
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
                if self.after_step is not None:
                    self.after_step(step)
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
        m: dict = {}
        temperature = self.cfg.rollout.temperature or 1.0  # the sampler's, passed to every log-prob computation
        profiled = self._profiled_groups(step)
        for g in profiled:
            g.run("profile_start")
        started = time.time()  # the phase calls from here on are this step's (call_metrics)
        with timer("step", m):
            self.rollout.boundary(step, m)  # async: wait for this step's batch, push weights, submit the next
            with timer("gen", m):  # rollout + reward (timing_s/reward: scoring; with DAPO, of every refill)
                batch, gen_metrics = self.rollout.next_batch(step, m)
            m.update(gen_metrics)
            if self.sleeps:
                with timer("rollout_sleep", m):
                    self.train_group.run("rollout_sleep")
            # async: the version being trained is step - 1 (rollout_source's staleness rule); its own tokens are
            # compared alone as well (rollout/logprob_diff_*_current)
            current = step - 1 if self.rollout.pipeline is not None else None
            batch = self._logprobs(batch, m, temperature, current)  # timing_s/old_log_prob, /ref, /values
            sampled_mask = batch.loss_mask  # before _advantages' truncation mask: the mismatch metrics' tokens
            with timer("adv", m):
                batch = self._advantages(batch, m)
            self._update(batch, m, step, temperature, sampled_mask)  # timing_s/update_critic, /update_actor
            self.rollout.after_update(step, m)  # async + rollout.partial: pushed now, into the batches in flight
            if self.rollout.pipeline is None:  # async: pushed at the next step's boundary
                with timer("update_weights", m):  # colocated: includes the engine's wake-up (timed alone too), if any
                    self.weight_sync.push(m)
        if profiled:
            self._write_profiles(profiled, step, m)

        n_tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
        m["perf/total_num_tokens"] = n_tokens
        m["perf/throughput"] = n_tokens / max(m["timing_s/step"], 1e-9)
        m["timing_s/reward"] = m.get("timing_s/reward", 0.0)
        m.update(memory_metrics())
        m.update(self.train_group.memory_metrics())  # per GPU under Ray
        if self.teacher_group not in (None, self.train_group):  # a teacher on its own devices
            m.update(self.teacher_group.memory_metrics())
            m.update(self.teacher_group.call_metrics(started))
        m.update(self.train_group.call_metrics(started))  # each phase: the ranks' work, Ray's dispatch and return
        if self.rollout_group is not self.train_group:  # async: read before its last submit, never while it generates
            pipe = self.rollout.pipeline
            m.update(pipe.idle_metrics if pipe is not None else self.rollout_group.memory_metrics())
            if pipe is None:
                for k, v in self.rollout_group.call_metrics(started).items():
                    m[k] = m.get(k, 0.0) + v
        m.update(plan_metrics(self.plan))  # the plan's prediction per GPU beside them (GPU runs only)
        return m

    # ------------------------------------------------------------------ profiling (trainer.profile_steps)
    def _profiled_groups(self, step: int) -> list:
        """The worker groups to profile this step: the training group, and a split rollout group unless it generates
        asynchronously (its window would not be this step's)."""
        if step not in self.cfg.trainer.profile_steps:
            return []
        groups = [self.train_group]
        if not self.colocated and self.rollout.pipeline is None:
            groups.append(self.rollout_group)
        return groups

    def _write_profiles(self, groups: list, step: int, m: dict) -> None:
        """Stop the workers' profilers and write their traces; a trace that cannot be written (a full disk, an
        unwritable trainer.profile_dir) is reported and the run goes on: the training is what the user asked for."""
        out = self.cfg.trainer.profile_dir or os.path.join(self.run_dir, "profile")
        m["perf/profiled"] = 1.0  # this step ran under the profiler: its times are not the run's
        paths = []
        for g in groups:  # each group's workers stop their profilers, written or not
            try:
                paths += g.run("profile_stop", out, step, g.name)
            except Exception as err:  # noqa: BLE001 (any writer's error; the step itself is done)
                print(f"rltrain: warning: step {step}'s profiler traces of the {g.name} workers were not written to "
                      f"{out}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        if paths:
            print(f"rltrain: step {step} profiled under torch.profiler: {len(paths)} trace(s) in "
                  f"{os.path.join(out, f'step{step}')} (python tools/profile_step.py DIR sums them by phase)",
                  flush=True)

    # ------------------------------------------------------------------ phases
    def _logprobs(self, batch: Batch, m: dict, temperature: float, current_version: int | None = None) -> Batch:
        """The actor's recomputed (old) log-probs and the mismatch to the sampler's (actor.recompute_old_logprobs=
        false: none here, the update gives them); the reference's, the distillation teacher's and the critic's
        values when used. The teacher scores the batch's tokens as trained (each sampled with the version it
        carries; at the sampler's temperature, as the old and reference log-probs)."""
        if self.cfg.actor.recompute_old_logprobs:
            with timer("old_log_prob", m):
                old, ent = gather_rows(self.train_group.run_split("compute_old_logprobs", batch, temperature), batch)
            batch = self._with_old(batch, old, ent, m, current_version)
            if self.cfg.actor.moe_routing_replay_compare:  # the same samples without replay: what it buys
                with timer("old_log_prob_no_replay", m):
                    free, _ = gather_rows(self.train_group.run_split("compute_old_logprobs", batch, temperature, False),
                                          batch)
                mm = policy_mismatch(free, batch.sampler_logprobs, batch.loss_mask)
                m.update({f"rollout/no_replay/{k}": float(mm[v]) for k, v in
                          (("mismatch_abs_mean", "abs_mean"), ("mismatch_kl", "kl"), ("logprob_diff_max", "abs_max"))})
        if self.use_ref:
            with timer("ref", m):
                ref = gather_rows(self.train_group.run_split("compute_ref_logprobs", batch, temperature), batch)
            batch = batch.replace(ref_logprobs=ref)
        if self.teacher_group is not None:
            with timer("teacher", m):
                teacher = gather_rows(self.teacher_group.run_split("compute_teacher_logprobs", batch, temperature),
                                      batch)
            batch = batch.replace(teacher_logprobs=teacher)
        if self.use_critic:
            with timer("values", m):
                values = gather_rows(self.train_group.run_split("compute_values", batch), batch)
            batch = batch.replace(values=values)
        return batch

    def _with_old(self, batch: Batch, old: torch.Tensor, ent: torch.Tensor, m: dict,
                  current_version: int | None = None) -> Batch:
        """`batch` with its old log-probs [B, R]; their entropy [B, R] and mismatch to the sampler's into `m`."""
        batch = batch.replace(old_logprobs=old)
        m["actor/entropy_rollout"] = _masked_mean(ent, batch.loss_mask)
        op = OffPolicyConfig.effective(self.cfg.actor, async_rollout=self.cfg.trainer.async_rollout)
        m.update(_mismatch_metrics(batch, op, current_version))
        return batch

    def _update(self, batch: Batch, m: dict, step: int, temperature: float, sampled_mask: torch.Tensor) -> None:
        """ppo_epochs over mini-batches: the critic's (PPO), then the actor's. actor.recompute_old_logprobs=false: the
        one on-policy mini-batch, whose forward's detached log-probs are the old ones; their metrics are logged as
        _logprobs logs the recomputed ones', over the same tokens (sampled_mask: the loss_mask before _advantages)."""
        cfg, a = self.cfg, self.cfg.actor
        mini_rows = a.ppo_mini_batch_size * cfg.rollout.n // self.train_group.dp_size
        if self.use_critic:
            with timer("update_critic", m), _diverged_as_error(step, self.ckpt_dir):
                res = self.train_group.run_split("update_critic", batch, max(1, mini_rows),
                                                 cfg.critic.ppo_epochs, self.seed + step)
            m.update(mean_metrics(res))
        method = "update_actor" if a.recompute_old_logprobs else "update_actor_on_policy"
        with timer("update_actor", m), _diverged_as_error(step, self.ckpt_dir):
            res = self.train_group.run_split(method, batch, max(1, mini_rows), a.ppo_epochs,
                                             temperature, self.seed + step)
        if not a.recompute_old_logprobs:  # per rank: (metrics, old log-probs [b, R], entropy [b, R])
            old, ent = gather_rows([(lp, e) for _, lp, e in res], batch)
            # with trainer.logprobs_loss_mask_only the update computes the trained tokens only
            mask = batch.loss_mask if cfg.trainer.logprobs_loss_mask_only else sampled_mask
            self._with_old(batch.replace(loss_mask=mask), old, ent, m)
            res = [r for r, _, _ in res]
        m.update(mean_metrics(res))

    def _score(self, batch: Batch) -> tuple[Batch, dict]:
        """The batch with its scores (rewards/scoring.score_batch, plus DAPO's overlong penalty) and reward metrics."""
        r, al = self.cfg.reward, self.cfg.algorithm
        scores_t, metrics = score_batch(batch, self.reward, tokenizer=self.tokenizer,
                                        multi_turn=self.cfg.rollout.multi_turn.enable, timeout_s=r.timeout_s,
                                        max_workers=r.max_workers)
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
        if batch.teacher_logprobs is not None:  # on-policy distillation, on the trained tokens (tool output masked)
            adv = adv + al.distill_coef * distill_advantages(batch.teacher_logprobs, batch.old_logprobs, loss_mask,
                                                             baseline=al.distill_baseline)
            m.update(_distill_metrics(batch))
        batch = batch.replace(token_rewards=token_rewards, advantages=adv * mask, returns=ret * mask,
                              loss_mask=loss_mask)
        m.update(stats("critic/rewards", token_rewards.sum(-1)))
        m.update(stats("critic/advantages", adv, batch.response_mask))
        m.update(stats("critic/returns", ret, batch.response_mask))
        if batch.values is not None:
            m.update(stats("critic/values", batch.values, batch.response_mask))
        return batch

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict:
        if self.val_ds is None:
            return {}
        self.rollout.before_validation(self.global_step)  # async: sample with the current weights
        bs = self.cfg.data.val_batch_size
        items = [self.val_ds[i] for i in range(len(self.val_ds))]
        scores, sources = [], []
        reward_sums: dict[str, float] = {}  # a dict reward's extra numbers (e.g. tool use), summed over rows
        for lo in range(0, len(items), bs):
            chunk = items[lo:lo + bs]
            batch, _ = self.rollout.generate(chunk, validate=True, seed=self.seed)
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
            # the data position (async: and the batch in flight, saved, not lost) and the RNGs
            state = {"step": step, **self.rollout.state_dict(), "rng": rng_state()}
            save_plain(state, os.path.join(tmp, TRAINER_STATE))

        path = save_checkpoint(self.ckpt_dir, step, write, max_to_keep=self.cfg.trainer.max_ckpt_to_keep)
        print(f"rltrain: saved checkpoint {path}", file=sys.stderr, flush=True)
        return path

    def _maybe_resume(self) -> int:
        path = resume_path(self.cfg.trainer.resume, self.ckpt_dir, upto=self.run_dir)
        if path is None:
            return 0
        with loading_checkpoint(path):  # another model shape, an unreadable file: message + exit 2
            state = read_trainer_state(path)  # data only; a field newer than the checkpoint takes its default
            self.train_group.run("load", path, self.cfg.rollout.weight_sync_bucket_mb << 20)
        if not self.colocated:
            self.weight_sync.push(version=int(state["step"]))
        with loading_checkpoint(path):  # a state of another format (its RNG, data position): message + exit 2
            set_rng_state(state["rng"])
            self.rollout.load_state_dict(state, int(state["step"]))
        print(f"rltrain: resumed from {path} (step {state['step']})", file=sys.stderr, flush=True)
        return int(state["step"])

    def _finish(self, export: bool = True) -> None:
        t = self.cfg.trainer
        if export and t.export_hf_on_end and self.global_step > 0:
            out = os.path.join(self.run_dir, "hf")
            self.train_group.run("export_hf", out)
            print(f"rltrain: exported the actor in transformers format to {out}", file=sys.stderr, flush=True)
        if self.tracker is not None:
            self.tracker.finish()
        groups = (self.train_group, self.rollout_group, self.teacher_group)
        for group in {id(g): g for g in groups if g is not None}.values():
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


def _mismatch_metrics(batch: Batch, op: OffPolicyConfig, current_version: int | None = None) -> dict[str, float]:
    """Training/inference mismatch of the sampled tokens (sampler vs recomputed old log-probs) and, with an
    off-policy correction (op: OffPolicyConfig.effective, actor.off_policy or actor.tis), every statistic of the
    weights the loss applies over the whole batch as rollout/is_<stat> (is_weight_mean, is_ratio_max, is_clipfrac
    for the *_tis modes, is_masked_frac for the *_mask and *_mis modes, ...: off_policy_weights' stats).
    current_version (async, with Batch.weight_versions): the same difference over the tokens the trained weights
    sampled themselves (staleness 0), rollout/logprob_diff_max_current and _nonzero_frac_current: the numerics'
    share of the mismatch, 0 under rollout.true_on_policy (older tokens differ by the policy's change, by design)."""
    mm = policy_mismatch(batch.old_logprobs, batch.sampler_logprobs, batch.loss_mask)
    out = {"rollout/mismatch_abs_mean": float(mm["abs_mean"]), "rollout/mismatch_kl": float(mm["kl"]),
           "rollout/logprob_diff_max": float(mm["abs_max"]),
           "rollout/logprob_diff_nonzero_frac": float(mm["nonzero_frac"])}
    if current_version is not None and batch.weight_versions is not None:
        own = batch.loss_mask.bool() & (batch.weight_versions == current_version)
        cm = policy_mismatch(batch.old_logprobs, batch.sampler_logprobs, own)
        out["rollout/logprob_diff_max_current"] = float(cm["abs_max"])
        out["rollout/logprob_diff_nonzero_frac_current"] = float(cm["nonzero_frac"])
    if op.mode != "none":
        corr = off_policy_weights(batch.old_logprobs, batch.sampler_logprobs, batch.loss_mask, mode=op.mode,
                                  cap=op.cap, low=op.low, high=op.high)
        out.update({f"rollout/is_{k}": float(v) for k, v in corr.stats.items()})
    return out


def _distill_metrics(batch: Batch) -> dict[str, float]:
    """The sampled per-token reverse KL to the teacher, log pi_old - log pi_teacher, over the sampled tokens
    (loss_mask): distill/reverse_kl/{mean,max,min} per token, distill/reverse_kl_seq/mean summed over a response."""
    kl = -distill_advantages(batch.teacher_logprobs, batch.old_logprobs, batch.loss_mask, baseline=False)
    return {**stats("distill/reverse_kl", kl, batch.loss_mask), "distill/reverse_kl_seq/mean": float(kl.sum(-1).mean())}


def _masked_mean(x: torch.Tensor | None, mask: torch.Tensor) -> float:
    if x is None:
        return float("nan")
    m = mask.float()
    return float((x * m).sum() / m.sum().clamp(min=1))


def _progress(t: TrainerConfig, start: int):
    if not t.progress_bar:
        return None
    from rltrain.utils.tracking import progress_bar

    return progress_bar(t.total_steps, start, "rltrain")


def run_from_config(cfg: RLConfig, run_dir: str | None = None, *,
                    after_step: Callable[[int], None] | None = None) -> dict:
    """Build the trainer from a typed RLConfig (the entry point converted it) and run it; returns the last step's
    metrics. after_step: see PPOTrainer."""
    run_dir = run_dir or run_directory()
    make_dirs(run_dir)
    write_text(os.path.join(run_dir, "config.json"), json.dumps(as_dict(cfg), indent=1))
    start = time.time()
    trainer = None
    try:
        trainer = PPOTrainer(cfg, run_dir, after_step=after_step)
        last = trainer.fit()
    except TrainingDiverged as err:
        print(f"rltrain: {err}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    except WorkerLost as err:
        print(f"rltrain: {err}. The run stops; {last_checkpoint(trainer.ckpt_dir)}. Rerun the same command with "
              "trainer.resume=auto to continue from it.", file=sys.stderr, flush=True)
        raise SystemExit(4) from None
    except KeyboardInterrupt:  # Ctrl-C: one line (the workers ignore SIGINT and are shut down by fit)
        line = interrupted_line(trainer.global_step, trainer.ckpt_dir, run_dir) if trainer else \
            "rltrain: interrupted while starting"
        print(line, file=sys.stderr, flush=True)
        to_log_files(line)
        raise SystemExit(130) from None
    line = f"rltrain: finished {cfg.trainer.total_steps} steps in {time.time() - start:.0f} s; run directory: {run_dir}"
    print(line, flush=True)
    to_log_files(line)
    return last
