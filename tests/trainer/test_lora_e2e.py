"""A short LoRA run of the tiny config (actor.lora.rank=8, in process): the rollout engine samples what the actor
computes after each adapter-only sync, the KL loss's reference is the actor's base, the checkpoint holds the adapters
alone, and python -m rltrain.export writes the PEFT adapter (the same as the run's end export) and the merged model,
whose weights are W + (alpha / r) B A of the run's base. The learning run: docs/benchmarks.md (LoRA)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_lora_run_syncs_adapters_serves_the_reference_and_exports_peft(tmp_path, cfg_for):
    from rltrain.data.tokenizer import load_tokenizer
    from rltrain.workers.hybrid import initial_hf_model

    run_dir = str(tmp_path / "lora")
    cfg = cfg_for("trainer.use_ray=false", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
                  "trainer.plots=false", "trainer.save_freq=2", "trainer.export_hf_on_end=true", "actor.lora.rank=8",
                  "actor.use_kl_loss=true", "actor.lr=1e-2", "actor.entropy_coef=0.01")  # a gradient without rewards
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4  # step 2 samples with the synced adapters
    assert rows[1]["actor/kl_loss"] > 0.0  # the reference (the base) is not the trained policy

    state = torch.load(os.path.join(run_dir, "checkpoints", "step_2", "worker_rank0.pt"), weights_only=True)
    assert state["actor"]["model"] and all(".lora." in k for k in state["actor"]["model"])

    tool = subprocess.run([sys.executable, "-m", "rltrain.export", os.path.join(run_dir, "checkpoints", "step_2"),
                           str(tmp_path / "tool"), "--merged"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert tool.returncode == 0, tool.stderr[-2000:]
    adapter = load_file(os.path.join(run_dir, "hf", "adapter_model.safetensors"))
    from_tool = load_file(str(tmp_path / "tool" / "adapter_model.safetensors"))
    assert set(adapter) == set(from_tool) and all(torch.equal(adapter[k], from_tool[k]) for k in adapter)
    assert all(adapter[k].abs().max() > 0 for k in adapter if ".lora_B." in k)  # trained from B = 0
    config = json.loads((tmp_path / "tool" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"

    tokenizer = load_tokenizer(cfg.model.tokenizer)
    _, base = initial_hf_model(cfg.model, tokenizer, cfg.trainer.seed, torch.float32)
    merged = load_file(str(tmp_path / "tool" / "merged" / "model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    for name, w in base.state_dict().items():
        a = adapter.get("base_model.model." + name.replace(".weight", ".lora_A.weight"))
        b = adapter.get("base_model.model." + name.replace(".weight", ".lora_B.weight"))
        want = w if a is None else w + scale * b @ a
        if name in merged:
            torch.testing.assert_close(merged[name], want, atol=1e-6, rtol=0)
