"""Builds what the driver loop needs from the config: tokenizer, datasets + sampler, reward fn, worker groups.

Construction only; the loop itself is in ppo.py.
"""

from __future__ import annotations

import os

import torch


def config_dict(cfg) -> dict:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return cfg


def run_directory() -> str:
    """Hydra's run dir when running under Hydra, else the current directory."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return os.getcwd()


def build_datasets(cfg: dict):
    from rltrain.data.dataset import PromptDataset, PromptSampler
    from rltrain.data.tokenizer import load_tokenizer
    from rltrain.rewards import get_reward_fn

    m, d = cfg["model"], cfg["data"]
    tokenizer = load_tokenizer(m["tokenizer"] or m["path"])
    if d["source"] == "synthetic":
        from rltrain.data.synthetic import SyntheticTaskDataset

        s = d["synthetic"]
        common = dict(tokenizer=tokenizer, apply_chat_template=d["apply_chat_template"],
                      system_prompt=d["system_prompt"])
        train = SyntheticTaskDataset(s["task"], s["seed"], s["train_size"], split="train", **common)
        val = SyntheticTaskDataset(s["task"], s["seed"], s["val_size"], split="val", **common)
    else:
        common = dict(prompt_key=d["prompt_key"], answer_key=d["answer_key"], data_source_key=d["data_source_key"],
                      tokenizer=tokenizer, max_prompt_length=d["max_prompt_length"],
                      apply_chat_template=d["apply_chat_template"], system_prompt=d["system_prompt"])
        def load(path):  # rows without a data_source key are tagged with the file's name
            name = os.path.splitext(os.path.basename(path))[0]
            return PromptDataset(path, default_data_source=name, **common)

        train = _concat([load(p) for p in d["train_files"]])
        val = _concat([load(p) for p in d["val_files"]]) if d["val_files"] else None
    sampler = PromptSampler(train, batch_size=d["train_batch_size"], seed=cfg["trainer"]["seed"], shuffle=d["shuffle"])
    reward = get_reward_fn(cfg["reward"]["fn"])
    return tokenizer, train, val, sampler, reward


def check_model(cfg: dict, tokenizer) -> None:
    """Resolve the model's HF config on the driver so a wrong model.path fails before workers start."""
    from rltrain.models.presets import model_hf_config

    model_hf_config(cfg["model"], tokenizer)


def _concat(datasets):
    if len(datasets) == 1:
        return datasets[0]
    return torch.utils.data.ConcatDataset(datasets)


def build_workers(cfg: dict, *, use_ref: bool, use_critic: bool):
    """(train group, rollout group): the same object in colocated mode."""
    from rltrain.workers.group import LocalWorkerGroup, WorkerGroup
    from rltrain.workers.hybrid import HybridWorker, resolve_device

    t, a = cfg["trainer"], cfg["actor"]
    device = resolve_device(t["device"])
    tp = a["tensor_parallel_size"] * a["pipeline_parallel_size"]
    if device == "cuda":
        world = t["n_gpus_per_node"] * t["nnodes"]
        gpus, cpus = 1, 1
    else:
        world, gpus = tp, 0
        groups = 2 if t["use_ray"] and not t["colocate"] else 1  # split: train and rollout groups share the CPUs
        cpus = max(1, (t["num_cpus"] or os.cpu_count() or 1) // (world * groups))
    train_roles = ["actor"] + (["ref"] if use_ref else []) + (["critic"] if use_critic else [])
    if not t["use_ray"]:
        if world != 1:
            raise ValueError(f"trainer.use_ray=false runs one in-process worker, but the config asks for {world} "
                             "(actor.tensor_parallel_size / trainer.n_gpus_per_node); enable Ray or use 1")
        group = LocalWorkerGroup(HybridWorker, worker_kwargs={"cfg": cfg, "roles": train_roles + ["rollout"]})
        group.setup()
        return group, group
    if t["colocate"]:
        group = WorkerGroup(HybridWorker, world, tp_size=tp, num_cpus_per_worker=cpus, num_gpus_per_worker=gpus,
                            worker_kwargs={"cfg": cfg, "roles": train_roles + ["rollout"]}, name="hybrid")
        group.setup()
        return group, group
    train = WorkerGroup(HybridWorker, world, tp_size=tp, num_cpus_per_worker=cpus, num_gpus_per_worker=gpus,
                        worker_kwargs={"cfg": cfg, "roles": train_roles}, name="train")
    rollout = WorkerGroup(HybridWorker, world, tp_size=cfg["rollout"]["tensor_parallel_size"],
                          num_cpus_per_worker=cpus, num_gpus_per_worker=gpus,
                          worker_kwargs={"cfg": cfg, "roles": ["rollout"]}, name="rollout")
    train.setup()
    rollout.setup()
    return train, rollout
