"""SFT: the assistant-only loss mask, the loss/gradient against an fp64 HF reference, a short run, the HF export."""

import json
import math
import os
import random

import pytest
import torch
from hydra import compose, initialize_config_dir

from rltrain.config import ConfigError, as_config, register_configs
from rltrain.config.schema import SFTConfig
from rltrain.config.validate import validate_sft_config
from rltrain.data.dataset import write_rows
from rltrain.data.retool_synthetic import make_splits, sft_conversation
from rltrain.data.sft_data import DEFAULT_TOOL_OUTPUT_TEMPLATE, SFTDataset, collate, encode_conversation
from rltrain.data.tokenizer import CharTokenizer
from rltrain.main import CONFIG_DIR
from rltrain.utils.tracking import read_metrics

register_configs()
pytestmark = pytest.mark.timeout(300)


def sft_cfg(*overrides):
    """The typed SFTConfig of retool_tiny_sft with `overrides`, validated (as rltrain.sft converts it)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = as_config(compose(config_name="retool_tiny_sft", overrides=["trainer.progress_bar=false",
                                                                          "trainer.logger=[jsonl]", *overrides]),
                        SFTConfig)
    validate_sft_config(cfg)
    return cfg


def test_mask_is_one_exactly_on_assistant_tokens_and_eos():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3+1"},
            {"role": "assistant", "content": "<code>print(2*3+1)</code>"}, {"role": "tool", "content": "7\n"},
            {"role": "assistant", "content": "#### 7"}]
    ids, mask, plen = encode_conversation(tok, msgs)
    # hand-built: prompt (template with generation prompt), then segments
    prompt = tok.encode("<bos><|system|>be brief<|end|><|user|>2*3+1<|end|><|assistant|>")
    a1, tool = tok.encode("<code>print(2*3+1)</code>"), tok.encode("\n<output>\n7\n\n</output>\n")
    a2 = tok.encode("#### 7")
    assert ids == prompt + a1 + tool + a2 + [tok.eos_token_id]
    assert mask == [0] * len(prompt) + [1] * len(a1) + [0] * len(tool) + [1] * len(a2) + [1]
    assert plen == len(prompt)
    # the masked-in text is exactly the assistant's
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "<code>print(2*3+1)</code>#### 7"


@pytest.mark.parametrize("msgs, needle", [
    ([{"role": "user", "content": "a"}], "no assistant message"),
    ([{"role": "assistant", "content": "a"}], "needs a user message"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
      {"role": "assistant", "content": "d"}], "only assistant/tool"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}],
     "last message must be the assistant"),
    ([{"role": "robot", "content": "a"}], "message 0"),
])
def test_bad_conversations_raise_clear_errors(msgs, needle):
    with pytest.raises(ValueError, match=needle):
        encode_conversation(CharTokenizer(), msgs, where="f.jsonl:3")


def test_sft_layout_uses_the_rollouts_tool_template_and_drops_long_rows():
    from rltrain.rollout.multiturn import DEFAULT_TOOL_OUTPUT_TEMPLATE as ROLLOUT_TEMPLATE

    assert DEFAULT_TOOL_OUTPUT_TEMPLATE == ROLLOUT_TEMPLATE
    convs = [sft_conversation(2, 3, 1), sft_conversation(19, 17, 20)]
    lens = [len(encode_conversation(CharTokenizer(), c)[0]) for c in convs]
    ds = SFTDataset([convs], tokenizer=CharTokenizer(), max_length=min(lens))
    assert len(ds) == 1 and ds.num_dropped == 1
    b = collate([encode_row(c) for c in convs], pad_token_id=0)
    assert b["input_ids"].shape == (2, max(lens)) and b["seq_lens"].tolist() == lens
    assert b["loss_mask"][0, lens[0]:].sum() == 0


def encode_row(conv):
    ids, mask, _ = encode_conversation(CharTokenizer(), conv)
    return {"input_ids": ids, "loss_mask": mask}


@pytest.mark.sandbox
def test_synthetic_traces_hold_the_real_sandbox_output_and_fit_the_char_vocab():
    from rltrain.sandbox import SandboxPool

    tok = CharTokenizer()
    splits = make_splits(sft_size=20, train_size=10, val_size=10, max_operand=12, seed=3)
    val_q = {r["prompt"][0]["content"] for r in splits["val"]}
    assert not val_q & {r["messages"][0]["content"] for r in splits["sft"]}
    assert not val_q & {r["prompt"][0]["content"] for r in splits["train"]}
    convs = [r["messages"] for r in splits["sft"][:3]]
    codes = [c[1]["content"][len("<code>"):-len("</code>")] for c in convs]
    pool = SandboxPool(2, timeout_s=10.0, memory_mb=256)
    try:
        outs = [r.to_tool_output() for r in pool.run_many(codes)]
    finally:
        pool.close()
    assert outs == [c[2]["content"] for c in convs]
    for c in convs:
        a, b, cc = map(int, c[0]["content"].replace("*", " ").replace("+", " ").split())
        assert c[3]["content"] == f"#### {a * b + cc}"
        ids = encode_conversation(tok, c)[0]
        assert tok.unk_token_id not in ids


def test_config_validation_names_the_bad_keys():
    with pytest.raises(ConfigError) as err:
        sft_cfg("data.train_files=[]", "optim.lr=-1", "data.batch_size=0")
    msg = str(err.value)
    assert "data.train_files" in msg and "optim.lr=-1.0" in msg and "data.batch_size=0" in msg


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft_data")
    splits = make_splits(sft_size=96, train_size=8, val_size=16, max_operand=20, seed=1)
    write_rows(splits["sft"], d / "sft.jsonl")
    write_rows([{"messages": sft_conversation(*map(int, r["prompt"][0]["content"].replace("*", " ")
                                                    .replace("+", " ").split()))} for r in splits["val"]],
               d / "val.jsonl")
    return str(d / "sft.jsonl"), str(d / "val.jsonl")


def _hf_reference(model_dir_or_model, batch):
    """fp64 masked token-mean NLL of batch under a transformers model (and its grad norm)."""
    model = model_dir_or_model.double()
    model.zero_grad()
    logits = model(batch["input_ids"]).logits  # [B, S, V]
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].double()
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    gn = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), gn


def test_sft_step_loss_and_grad_norm_match_fp64_hf_reference(tmp_path, sft_files):
    from rltrain.trainer.sft import SFTTrainer
    from rltrain.workers.hybrid import initial_hf_model

    # a tiny token budget forces several micro-batches of different widths: weighting must be exact
    cfg = sft_cfg(f"data.train_files=[{sft_files[0]}]", "trainer.max_tokens_per_micro_batch=120",
                  "data.batch_size=7", "trainer.seed=5")
    trainer = SFTTrainer(cfg, str(tmp_path))
    rows = [trainer.train_ds[i] for i in random.Random(0).sample(range(len(trainer.train_ds)), 7)]
    batch = collate(rows, 0)
    _, hf = initial_hf_model(cfg.model, trainer.tokenizer, 5, torch.float32)  # the trainer's start weights
    ref_loss, ref_gn = _hf_reference(hf, batch)
    m = trainer.train_step(batch)
    assert m["sft/loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert m["sft/grad_norm"] == pytest.approx(ref_gn, rel=1e-4)
    assert m["sft/tokens"] == float(batch["loss_mask"].sum())


def test_short_sft_run_learns_logs_and_exports_a_loadable_hf_model(tmp_path, sft_files):
    from transformers import AutoModelForCausalLM

    from rltrain.data.tokenizer import load_tokenizer
    from rltrain.trainer.sft import run_sft_from_config

    out = tmp_path / "hf"
    cfg = sft_cfg(f"data.train_files=[{sft_files[0]}]", f"data.val_files=[{sft_files[1]}]", "trainer.total_steps=30",
                  "data.batch_size=16", f"trainer.output_dir={out}", "trainer.test_freq=15")
    last = run_sft_from_config(cfg, str(tmp_path / "run"))
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == list(range(1, 31))
    for k in ("sft/loss", "sft/grad_norm", "sft/lr", "timing_s/step", "sft/entropy"):
        assert all(math.isfinite(r[k]) for r in rows), k
    assert rows[-1]["sft/loss"] < 0.6 * rows[0]["sft/loss"]
    assert "sft/val_loss" in rows[14] and "sft/val_loss" in rows[29]
    assert last["output_dir"] == str(out)
    assert {"config.json", "model.safetensors", "char_tokenizer.json"} <= set(os.listdir(out))
    assert not os.path.exists(str(out) + ".tmp")
    assert json.load(open(tmp_path / "run" / "config.json"))["trainer"]["total_steps"] == 30
    # transformers loads it, and its NLL on the validation rows equals the engine's (the export is exact)
    tok = load_tokenizer(str(out))
    val = SFTDataset([sft_files[1]], tokenizer=tok, max_length=128)
    batch = collate([val[i] for i in range(len(val))], 0)
    hf_loss, _ = _hf_reference(AutoModelForCausalLM.from_pretrained(str(out)), batch)
    assert hf_loss == pytest.approx(rows[-1]["sft/val_loss"], rel=1e-4)


def test_interrupted_sft_resumes_exactly_on_the_uninterrupted_loss_curve(tmp_path, sft_files):
    """#38 item 9: an SFT stopped after a checkpoint (a deadline) continues from it; steps after the checkpoint
    have the losses, grad norms and lrs of the run that was never stopped (cosine schedule, sampler mid-epoch)."""
    from rltrain.trainer.sft import SFTTrainer
    from rltrain.utils.checkpoint import list_checkpoints

    over = (f"data.train_files=[{sft_files[0]}]", "trainer.total_steps=6", "data.batch_size=8",
            "trainer.save_freq=2", "trainer.max_ckpt_to_keep=1", "optim.lr=1e-3")
    keys = ("sft/loss", "sft/grad_norm", "sft/lr")

    def curve(run_dir):
        return {r["step"]: tuple(r[k] for k in keys) for r in read_metrics(run_dir)}

    full = tmp_path / "full"
    SFTTrainer(sft_cfg(*over, f"trainer.output_dir={full / 'hf'}"), str(full)).fit()

    cut = tmp_path / "cut"
    stopped = SFTTrainer(sft_cfg(*over, f"trainer.output_dir={cut / 'hf'}"), str(cut))
    real_step = stopped.train_step
    steps = []

    def deadline(batch):  # the 5th step never finishes: the run dies after step 4's checkpoint
        steps.append(1)
        if len(steps) == 5:
            raise KeyboardInterrupt("deadline")
        return real_step(batch)

    stopped.train_step = deadline
    with pytest.raises(KeyboardInterrupt):
        stopped.fit()
    assert [s for s, _ in list_checkpoints(str(cut / "checkpoints"))] == [4]
    from rltrain.utils.rundir import interrupted_line  # what rltrain.sft prints on Ctrl-C

    assert interrupted_line(stopped.step, stopped.ckpt_dir, str(cut)).startswith(
        f"rltrain: interrupted at step 5; the last good checkpoint is {cut / 'checkpoints' / 'step_4'} (step 4); "
        "resume with: ")

    resumed_dir = tmp_path / "resumed"  # a fresh run directory pointed at the stopped run's checkpoints
    resumed = SFTTrainer(sft_cfg(*over, f"trainer.ckpt_dir={cut / 'checkpoints'}",
                                 f"trainer.output_dir={resumed_dir / 'hf'}"), str(resumed_dir))
    resumed.fit()
    want, got = curve(str(full)), curve(str(resumed_dir))
    assert sorted(got) == [5, 6]
    assert {s: want[s] for s in (5, 6)} == got  # exactly: same floats
    assert {s: want[s] for s in (1, 2, 3, 4)} == {s: v for s, v in curve(str(cut)).items() if s <= 4}
    never = SFTTrainer(sft_cfg(*over, f"trainer.ckpt_dir={cut / 'checkpoints'}", "trainer.resume=never",
                               "trainer.total_steps=6"), str(tmp_path / "never"))
    assert never._maybe_resume() == 0


def _dp2_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks of a data-parallel SFT (the torchrun layout) running the config in out_dir/cfg.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from rltrain.trainer.sft import SFTTrainer

    with open(os.path.join(out_dir, "cfg.json")) as f:
        cfg = json.load(f)
    run_dir = cfg.pop("_run_dir")
    SFTTrainer(as_config(cfg, SFTConfig), run_dir).fit()


def test_data_parallel_sft_checkpoints_every_rank_and_resumes_exactly(tmp_path, sft_files):
    """Two data-parallel ranks: the checkpoint holds each rank's engine state (rank 0's temp dir, shared by
    broadcast), and a run resumed from step 2 continues on the uninterrupted curve."""
    import socket
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
    from _megatron_ref import start_ranks  # ranks forked from a server that imported the stack once

    from rltrain.config.convert import as_dict

    def run(name, *extra):
        cfg = as_dict(sft_cfg(f"data.train_files=[{sft_files[0]}]", "trainer.total_steps=4", "data.batch_size=8",
                              "trainer.save_freq=2", "optim.lr=1e-3", f"trainer.ckpt_dir={tmp_path / 'ckpt'}", *extra))
        cfg["_run_dir"] = str(tmp_path / name)
        cfg["trainer"]["output_dir"] = str(tmp_path / name / "hf")
        with open(tmp_path / "cfg.json", "w") as f:
            json.dump(cfg, f)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start_ranks(_dp2_rank, (2, port, str(tmp_path)), 2)
        return {r["step"]: (r["sft/loss"], r["sft/grad_norm"]) for r in read_metrics(str(tmp_path / name))}

    full = run("full", "trainer.resume=never")
    assert {"rank0.pt", "rank1.pt", "trainer_state.pt"} <= set(os.listdir(tmp_path / "ckpt" / "step_2"))
    resumed = run("resumed", f"trainer.resume={tmp_path / 'ckpt' / 'step_2'}")
    assert sorted(resumed) == [3, 4]
    assert resumed == {s: full[s] for s in (3, 4)}
