"""The learning recipe (examples/learn/): its BPE tokenizer, and the CPU-scaled recipe learning end to end.

The end-to-end test runs tools/learn_gpu.py's stages data -> sft -> grpo at --scale cpu in this process and
asserts that held-out accuracy (128 problems no stage trains on) rises through SFT (from random init) and again
through GRPO, measured against the stage before. It runs the recipe's defaults (data seed 0, SFT and GRPO seed
1), not a picked seed. Seeds tried, all five passing with these margins (docs/benchmarks/offpolicy.md), SFT ->
after 15 GRPO steps: data/SFT/GRPO seed 0/1/1 0.531 -> 0.805; 1/1/1 0.547 -> 0.789; 2/2/2 0.555 -> 0.891;
3/3/3 0.477 -> 0.734; 4/4/4 0.477 -> 0.883 (2026-11-23; seed 0/1/1 ends at 0.773 on another machine). It also checks that the trainer's own validation at GRPO step 0
equals the driver's separate evaluation of the SFT model (rltrain/trainer/evaluate.py: two rollouts, one scorer,
rewards.scoring.score_batch, one number), that a second
call skips finished stages and exports at most 8 flat files, and that a deadline too short starts nothing.
The ReTool half (examples/learn/cpu.sh, ~2-3 min on 2 cores) does not fit the CI budget; its numbers are in
docs/benchmarks.md.
"""

import importlib.util
import json
import os
import sys
import tarfile

import pytest

from rltrain.data.arithmetic import make_splits
from rltrain.data.sft_data import DEFAULT_TOOL_OUTPUT_TEMPLATE, encode_conversation
from rltrain.data.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from rltrain.data import train_tokenizer as tt
    d = tmp_path_factory.mktemp("tok")
    rows = []
    for task in ("add", "mul_tool"):
        s = make_splits(task, sft_size=200, train_size=50, val_size=0, digits=4, short_digits=2)
        rows += s["sft"] + s["train"]
    path = d / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tt.train_tokenizer(tt.corpus([str(path)]), str(d / "tok"), vocab_size=300)
    return str(d / "tok")


def test_bpe_tokenizer_loads_through_load_tokenizer_and_round_trips(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert tok.vocab_size == len(tok) <= 300
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for text in ["4738+2956=", "8+6+0=14\n#### 7694", "<code>print(4738*29)</code>", "héllo wörld ∑ 3.14 {x}"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text  # byte-level: no <unk>, nothing lost
    digits = tok.convert_ids_to_tokens(tok.encode("90817", add_special_tokens=False))
    assert digits == list("90817")  # every digit is its own token
    assert "####" in tok.get_vocab()  # a merge learned from the corpus


def test_chat_template_and_sft_layout(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    msgs = [{"role": "user", "content": "12*3="}, {"role": "assistant", "content": "<code>print(12*3)</code>"},
            {"role": "tool", "content": "36\n"}, {"role": "assistant", "content": "#### 36"}]
    prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\n12*3=<|im_end|>\n<|im_start|>assistant\n"
    ids, mask, plen = encode_conversation(tok, msgs)
    assert tok.decode(ids, skip_special_tokens=False) == (
        prompt + "<code>print(12*3)</code>" + DEFAULT_TOOL_OUTPUT_TEMPLATE.replace("{output}", "36\n")
        + "#### 36<|im_end|>")
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == \
        "<code>print(12*3)</code>#### 36<|im_end|>"
    assert ids[-1] == tok.eos_token_id and plen == len(tok.encode(prompt, add_special_tokens=False))


def test_train_tokenizer_cli_rejects_a_too_small_vocab(tmp_path, capsys):
    from rltrain.data import train_tokenizer as tt
    (tmp_path / "r.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(SystemExit) as exc:
        tt.main(["--files", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "t"), "--vocab-size", "100"])
    assert exc.value.code == 2 and "vocab_size" in capsys.readouterr().err


def test_driver_refuses_a_stage_whose_inputs_are_missing(tmp_path, capsys):
    learn = _tool("learn_gpu")
    assert learn.main(["grpo", "--scale", "cpu", "--out", str(tmp_path)]) == 2
    assert "run the `sft` stage first" in capsys.readouterr().err
    assert learn.main(["sft", "--scale", "cpu", "--out", str(tmp_path), "--set", "nope"]) == 2


def test_driver_refuses_retool_where_the_sandbox_cannot_isolate(tmp_path, capsys, monkeypatch):
    import rltrain.sandbox

    learn = _tool("learn_gpu")
    (tmp_path / "data" / "tokenizer").mkdir(parents=True)
    (tmp_path / "data" / "mul_tool").mkdir()
    (tmp_path / "data" / "mul_tool" / "sft.jsonl").write_text("")
    unisolated = rltrain.sandbox.SandboxResult(status="ok", stdout="", stderr="", exit_code=0, duration_s=0.1,
                                               isolation="none (landlockpy missing)", isolated=False)
    monkeypatch.setattr(rltrain.sandbox, "probe_isolation", lambda **_: unisolated)
    assert learn.main(["retool_sft", "--scale", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "landlockpy missing" in err and "--allow-unisolated" in err and "sandbox-wheels" in err


@pytest.mark.timeout(600)
def test_cpu_recipe_accuracy_rises_through_sft_and_grpo(tmp_path):
    learn = _tool("learn_gpu")
    out = tmp_path / "learn"
    assert learn.main(["data", "sft", "grpo", "--scale", "cpu", "--out", str(out), "--in-process"]) == 0
    s = json.loads((out / "summary.json").read_text())
    sft, grpo = s["sft"], s["grpo"]
    run = grpo["runs"]["fused_seed1"]
    assert sft["before"]["accuracy"] <= 0.02  # random init
    assert sft["after"]["accuracy"] >= 0.35  # seeds 0-4: 0.477-0.555
    assert run["steps_done"] == run["total_steps"]
    assert run["after"]["accuracy"] >= sft["after"]["accuracy"] + 0.15  # seeds 0-4: +0.24 to +0.41
    # the trainer's validation at step 0 and the driver's evaluation of the SFT model agree
    curve = dict(run["curve"]["val/accuracy"])
    assert curve[0] == pytest.approx(sft["after"]["accuracy"])
    assert curve[run["total_steps"]] == pytest.approx(run["after"]["accuracy"])
    assert (out / "plots" / "grpo_curves.png").stat().st_size > 10_000
    assert "| grpo | fused_seed1" in (out / "summary.md").read_text()

    # Run again: finished stages are skipped (no training, same numbers), and the export is what the device
    # machine returns from $OUT: at most 8 flat files, the log archive holding every run's metrics.
    export = tmp_path / "export"
    assert learn.main(["sft", "grpo", "--scale", "cpu", "--out", str(out), "--in-process",
                       "--export", str(export)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["grpo"]["runs"]["fused_seed1"]["after"] == run["after"] and again["sft"]["after"] == sft["after"]
    files = sorted(p.name for p in export.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in export.iterdir()), files
    assert {"summary.md", "summary.json", "benchmarks.md", "grpo_curves.png", "learn_logs.tar.gz"} <= set(files)
    with tarfile.open(export / "learn_logs.tar.gz") as tar:
        assert {"grpo/fused_seed1/metrics.jsonl", "sft/run/metrics.jsonl"} <= set(tar.getnames())
    assert "| grpo | fused_seed1 |" in (export / "benchmarks.md").read_text()

    # A deadline too short to start a GRPO run: nothing starts, exit 3 (run again), the finished run stays.
    assert learn.main(["grpo", "--runs", "fused:2", "--scale", "cpu", "--out", str(out), "--deadline", "1"]) == 3
    assert set(json.loads((out / "summary.json").read_text())["grpo"]["runs"]) == {"fused_seed1"}


def test_run_specs_pick_engines_and_the_comparisons_test_engines_and_lora_against_seed_noise(capsys):
    """A worked example: three finished runs from one SFT model, hf seed 1 and vllm seeds 1 and 2, on 64 held-out
    prompts (2 SE = 2 * sqrt(0.5 / 64) = 0.177)."""
    learn = _tool("learn_gpu")
    specs = [learn.RunSpec.parse(t) for t in ("fused:1", "fused:1:vllm", "unfused:2:hf", "lora:3")]
    assert [s.name for s in specs] == ["fused_seed1", "fused_seed1_vllm", "unfused_seed2_hf", "lora_seed3"]
    assert [s.engine for s in specs] == [None, "vllm", "hf", None]
    assert [learn.RunSpec.from_name(s.name) for s in specs] == specs  # run directories name their spec
    for bad in ("fused", "fused:x", "fused:1:sglang", "fused:1:vllm:2", "mixed:1", "lora"):
        with pytest.raises(learn.UsageError, match="fused:SEED"):
            learn.RunSpec.parse(bad)

    def run(*acc):
        return {"after": {}, "curve": {"val/accuracy": [[10 * i, a] for i, a in enumerate(acc)]}}

    runs = {"fused_seed1": run(0.1, 0.5, 0.9), "fused_seed1_vllm": run(0.1, 0.3, 0.8),
            "fused_seed2_vllm": run(0.1, 0.6, 1.0), "fused_seed3_vllm": {"curve": {}}}  # unfinished: left out
    c = learn.compare_runs(runs, 64, default_engine="hf")
    assert "gap_fused_unfused" not in c  # no materialized-logits run
    e = c["engines"]
    assert (e["reference"], e["engine"], e["seed_a"], e["seed_b"]) == (
        "fused_seed1", "fused_seed1_vllm", "fused_seed1_vllm", "fused_seed2_vllm")
    # steps 10 and 20 (step 0 left out): |0.5-0.3|, |0.9-0.8| -> 0.15; seeds |0.3-0.6|, |0.8-1.0| -> 0.25
    assert e["gap_engines"] == pytest.approx(0.15) and e["gap_seeds"] == pytest.approx(0.25)
    assert e["two_se"] == pytest.approx(2 * (0.5 / 64) ** 0.5) and e["within_noise"]
    assert e["gaps_by_seed"] == {"fused_seed1 vs fused_seed1_vllm": pytest.approx(0.15)}
    # two hf seeds: the noise is the reference engine's; a vLLM run that never learns is outside it
    runs = {"fused_seed1": run(0.1, 0.5, 0.9), "fused_seed2": run(0.1, 0.6, 1.0), "fused_seed1_vllm": run(0.1, 0.1, 0.1),
            "unfused_seed1": run(0.1, 0.5, 0.8)}
    c = learn.compare_runs(runs, 64)
    assert (c["engines"]["seed_a"], c["engines"]["seed_b"]) == ("fused_seed1", "fused_seed2")
    assert c["engines"]["gap_engines"] == pytest.approx(0.6) and not c["engines"]["within_noise"]
    # with both seeds run on both engines, the worse seed decides: seed 2's vLLM run is the one off
    runs.update(fused_seed1_vllm=run(0.1, 0.5, 0.9), fused_seed2_vllm=run(0.1, 0.0, 0.2))
    e = learn.compare_runs(runs, 64)["engines"]
    assert (e["reference"], e["engine"]) == ("fused_seed2", "fused_seed2_vllm") and e["gap_engines"] == pytest.approx(0.7)
    assert e["gaps_by_seed"]["fused_seed1 vs fused_seed1_vllm"] == 0 and not e["within_noise"]
    # and fused vs unfused is compared within the hf runs: |0.8-0.9| / 2 = 0.05
    assert c["unfused"] == "unfused_seed1" and c["gap_fused_unfused"] == pytest.approx(0.05) and c["within_noise"]

    # LoRA against full fine-tuning: seed 1 of each against LoRA's two seeds (full fine-tuning has one);
    # |0.5-0.2|, |0.9-0.7| -> 0.25 against |0.2-0.4|, |0.7-0.9| -> 0.2 + 2 SE: within noise
    runs = {"fused_seed1": run(0.1, 0.5, 0.9), "lora_seed1": run(0.1, 0.2, 0.7), "lora_seed2": run(0.1, 0.4, 0.9)}
    runs["fused_seed1"]["timing"], runs["lora_seed1"]["timing"] = {"step_s": 2.5}, {"step_s": 2.0}
    lo = learn.compare_runs(runs, 64)["lora"]
    assert (lo["full"], lo["lora"], lo["seed_a"], lo["seed_b"]) == ("fused_seed1", "lora_seed1", "lora_seed1",
                                                                    "lora_seed2")
    assert lo["gap_lora"] == pytest.approx(0.25) and lo["gap_seeds"] == pytest.approx(0.2) and lo["within_noise"]
    assert lo["step_s"] == {"fused_seed1": 2.5, "lora_seed1": 2.0, "lora_seed2": None}
    assert "LoRA vs full fine-tuning: mean |held-out accuracy gap| 0.250" in learn.comparison_lines({"lora": lo})[0]
    # true on-policy against the fused runs, on vLLM: the same pairing, its own entry and sentence
    runs = {"fused_seed1_vllm": run(0.1, 0.5, 0.9), "fused_seed2_vllm": run(0.1, 0.3, 0.9),
            "top_seed1_vllm": run(0.1, 0.4, 0.9)}
    top = learn.compare_runs(runs, 64)["top"]
    assert (top["full"], top["top"]) == ("fused_seed1_vllm", "top_seed1_vllm") and "lora" not in learn.compare_runs(runs, 64)
    assert top["gap_true_on_policy"] == pytest.approx(0.05) and top["gap_seeds"] == pytest.approx(0.1) and top["within_noise"]
    assert learn.comparison_lines({"top": top})[0].startswith("rollout.true_on_policy vs the fused run: mean |held-out "
                                                             "accuracy gap| 0.050")
    spec = learn.RunSpec.parse("top:2:vllm")
    assert spec.name == "top_seed2_vllm" and "rollout.true_on_policy=true" in spec.overrides()
    # held-out accuracy by training seconds: the step times summed up to each evaluation (step 0 at 0 s)
    rows = [{"step": 0, "val/accuracy": 0.1}, {"step": 1, "timing_s/step": 1.5},
            {"step": 2, "timing_s/step": 2.25, "val/accuracy": 0.5}]
    assert learn.curve(rows)[learn.TRAIN_S_KEY] == [[0.0, 0.1], [3.75, 0.5]]
