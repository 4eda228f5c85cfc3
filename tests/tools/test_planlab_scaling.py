"""tools/planlab/scaling.py and rltrain/utils/flops.py: the model reproduces its calibration points, and the FLOP,
parameter and byte counts match a 2-layer toy shape worked by hand."""

import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

from planlab import scaling  # noqa: E402
from planlab.scaling_inputs import all_inputs  # noqa: E402
from rltrain.utils.flops import matmul_params, num_params, train_flops  # noqa: E402

# 2 layers, hidden 8, 2 query heads and 1 KV head of 4, MLP 12, vocab 10, untied LM head
TOY = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                      intermediate_size=12, vocab_size=10, tie_word_embeddings=False, model_type="qwen3",
                      num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, decoder_sparse_step=1,
                      mlp_only_layers=[])  # dense: the MoE fields as a dense preset's shape has them


def test_toy_shape_params_and_flops_by_hand():
    # per layer: q,k,v = 8 x (8 + 4 + 4) = 128; o = 8 x 8 = 64; gate, up, down = 3 x 8 x 12 = 288 -> 480
    # matrices: 2 layers x 480 + LM head 10 x 8 = 1,040
    assert matmul_params(TOY) == 1040
    # + input embedding 80 (untied) + per layer 2 norms of 8 and q/k norms of 4 (2 x 24 = 48) + final norm 8
    assert num_params(TOY) == 1176
    tied = SimpleNamespace(**{**vars(TOY), "tie_word_embeddings": True})
    assert num_params(tied) == 1096
    # 3 tokens in sequences of 4: forward per token 2 x 1,040 + attention 2 (QK, PV) x 2 x 2 layers x 8 x 4/2 = 128
    assert train_flops(TOY, 3, 4) == 3 * 3 * (2080 + 128)


def test_qwen3_06b_param_count_matches_the_published_one():
    # Qwen3-0.6B (tied embeddings): 596,049,920 parameters in the published checkpoint
    assert num_params(scaling.shape("qwen3-0.6b")) == 596_049_920
    assert 4.0e9 < num_params(scaling.shape("qwen3-4b")) < 4.03e9  # "Qwen3-4B": 4.02B
    assert 8.18e9 < num_params(scaling.shape("qwen3-8b")) < 8.2e9  # "Qwen3-8B": 8.19B (untied head)


def test_toy_bytes_moved_by_hand():
    inp = all_inputs()
    lay = scaling.Layout("toy", 4, "colocated", tp=2, pp=1, rollout_tp=2, train_gpus=4, rollout_gpus=4)
    rec = scaling.Recipe(seqs_per_gpu=2, prompt_len=3, response_len=5, minibatches=2, mb_tokens=16)
    eff = scaling.Eff(mfu_update=0.5, ratio_old=1.0, ratio_ref=1.0, tp_eff=1.0)
    tr = scaling.train_phases(TOY, lay, rec, eff, inp, n_seqs=8)
    # 8 sequences x 8 tokens / DP 2 = 32 tokens per DP rank -> 2 micro-batches of 16
    assert tr["micro_batches_per_rank"] == 2
    # TP: 2 micro-batches x 2 layers x 4 all-reduces x (16 x 8 x 2 B = 256 B) x 2(2-1)/2
    assert tr["update_actor"]["tp_bytes"] == 2 * 2 * 4 * 256
    assert tr["old_log_prob"]["tp_bytes"] == 2 * 2 * 2 * 256
    # DP: bf16 grads of 1,176 / TP 2 params = 1,176 B, x 2(2-1)/2, per optimizer step, 2 steps
    assert tr["update_actor"]["dp_bytes"] == 2 * 1176
    bw, lat = inp["busbw_intra"].value, inp["lat_intra_s"].value
    # one 64 MiB bucket holds all 1,176 B: one latency, and the last (only) bucket cannot hide behind the backward
    assert tr["update_actor"]["dp_comm_s"] == pytest.approx(2 * (1176 / bw + lat))
    assert tr["update_actor"]["dp_comm_total_s"] == pytest.approx(2 * (1176 / bw + lat))
    # compute: 3 x 32 tokens x (2 x 1,040 + 2 x 2 x 2 x 8 x 8/2) / TP 2 at half of peak
    flops = 3 * 32 * (2080 + 256) / 2
    assert tr["update_actor"]["compute_s"] == pytest.approx(flops / (0.5 * inp["peak_flops"].value))
    sync = scaling.sync_phase(TOY, lay, inp)
    assert sync["bytes_per_replica"] == 2 * 1176 and sync["bytes_total"] == 2 * 2 * 1176  # 2 replicas of TP 2
    # the checkpoint's tensors, each loaded at rltrain.plan's cost: per layer q, k, v, o, gate, up, down, 2 norms,
    # q/k norms (11) x 2 layers + embedding, final norm, untied LM head = 25
    assert sync["tensors"] == 25
    assert sync["load_s"] == pytest.approx(25 * inp["reload_s_per_tensor"].value)
    split = scaling.Layout("toy", 4, "split", tp=2, pp=1, rollout_tp=2, train_gpus=2, rollout_gpus=2)
    assert scaling.sync_phase(TOY, split, inp)["load_s"] == pytest.approx(25 * inp["split_sync_s_per_tensor"].value)
    # TP all-gather of the bf16 weights: (2-1)/2 of 2,352 B per rank
    assert sync["gather_s"] == pytest.approx(1176 / bw + lat)
    # KV cache (the planner's rule, rltrain/plan/memory.py): K and V x 2 layers x 1 head x 4 x 2 B; at least one
    # KV head per rank, so TP 2 of TOY's single head still holds all of it
    assert scaling.kv_bytes_per_token(TOY, 1, 2) == scaling.kv_bytes_per_token(TOY, 2, 2) == 32


def test_calibration_points_are_reproduced():
    inp = all_inputs()
    rows = scaling.calibration(inp, scaling.fit_decode(inp))
    assert len(rows) == 7
    for r in rows[:-1]:  # the GRPO phases and the three vLLM points are fitted: exact up to rounding
        assert r["model_s"] == pytest.approx(r["measured"].value, rel=1e-9), r["what"]
    # TP=2 update: the measured TP efficiency already holds the communication, the model adds it again (< 5%)
    assert rows[-1]["model_s"] == pytest.approx(rows[-1]["measured"].value, rel=0.05)
    cal = scaling.fit_decode(inp)
    assert 0 < cal.step_s < 0.01 and 0 < cal.call_s < 1 and 0 < cal.lat_ar_s < 1e-4


def test_generation_grows_with_response_length_and_batch():
    inp = all_inputs()
    cal = scaling.fit_decode(inp)
    cfg = scaling.shape("qwen3-4b")
    args = dict(tp=2, hbm_bw=inp["hbm_bw_h200"].value, gemm=inp["gemm_tflops_h100"].value, cal=cal)
    times = [scaling.gen_seconds(cfg, b, 512, r, **args)["s"] for b, r in ((64, 1024), (64, 2048), (128, 2048))]
    assert times[0] < times[1] < times[2]


def test_weak_scaling_never_gains_per_gpu_at_a_fixed_layout():
    res = scaling.predict(all_inputs(), scaling.Recipe())
    for name in scaling.BASE_LAYOUT:
        col = [p for p in res["predictions"] if p["shape"] == name and p["layout"]["placement"] == "colocated"]
        assert [p["layout"]["n_gpus"] for p in col] == list(scaling.SCALES)
        assert col[0]["tok_s_per_gpu"] >= col[1]["tok_s_per_gpu"] >= col[2]["tok_s_per_gpu"]


def test_toy_dp_buckets_hide_behind_the_last_backward(monkeypatch):
    inp = all_inputs()
    lay = scaling.Layout("toy", 4, "colocated", tp=2, pp=1, rollout_tp=2, train_gpus=4, rollout_gpus=4)
    rec = scaling.Recipe(seqs_per_gpu=2, prompt_len=3, response_len=5, minibatches=2, mb_tokens=16)
    eff = scaling.Eff(mfu_update=1e-9, ratio_old=1.0, ratio_ref=1.0, tp_eff=1.0)  # slow compute: long backward
    monkeypatch.setattr(scaling, "DP_BUCKET_BYTES", 100)
    upd = scaling.train_phases(TOY, lay, rec, eff, inp, n_seqs=8)["update_actor"]
    bw, lat = inp["busbw_intra"].value, inp["lat_intra_s"].value
    dp_s = 1176 / bw + 12 * lat  # ceil(1,176 / 100) = 12 buckets
    last_bwd = upd["compute_s"] / 2 / 1 * 2 / 3  # 2 mini-batches of 1 micro-batch; backward = 2/3 of it
    assert last_bwd > dp_s  # all but the last bucket hide
    assert upd["dp_comm_total_s"] == pytest.approx(2 * dp_s)
    # the last bucket: the input embedding's shard, 2 B x 10 x 8 / TP 2 = 80 B, or a full 100 B bucket if larger
    assert upd["dp_comm_s"] == pytest.approx(2 * (100 / bw + lat))
    pp = scaling.Layout("toy", 4, "colocated", tp=1, pp=2, rollout_tp=2, train_gpus=4, rollout_gpus=4)
    upd = scaling.train_phases(TOY, pp, rec, eff, inp, n_seqs=8)["update_actor"]
    assert upd["dp_comm_s"] == pytest.approx(upd["dp_comm_total_s"])  # under PP nothing overlaps


def test_step_levers_drop_the_old_logprob_pass_and_the_sleep_wake():
    inp = all_inputs()
    cal = scaling.fit_decode(inp)
    lay = scaling.colocated(8, 2, 1, 2)
    base = scaling.step("qwen3-4b", lay, scaling.Recipe(), inp, cal)
    lev = scaling.step("qwen3-4b", lay, scaling.Recipe(recompute_old_logprobs=False, free_cache_engine=False), inp, cal)
    # actor.recompute_old_logprobs=false: no old-log-prob pass (the reference's stays); the update is the same
    assert base["phases"]["old_log_prob"] > 0 and lev["phases"]["old_log_prob"] == 0.0
    assert lev["phases"]["ref"] == pytest.approx(base["phases"]["ref"])
    assert lev["phases"]["update_actor"] == pytest.approx(base["phases"]["update_actor"])
    # rollout.free_cache_engine=false: vLLM (TP 2) never sleeps, so neither its sleep nor its wake is paid
    # rltrain.plan's level-2 sleep and wake, by hand: the 4B's 8.0 GB over a TP=2 engine per GPU, the node's 8 GPUs at
    # once
    v = {k: inp[k].value for k in ("vllm_sleep_s", "vllm_wake_s", "vllm_wake_s_per_gb", "vllm_rank_sync_factor")}
    gb = 2 * 4.022e9 / 1e9
    sleep_wake = ((v["vllm_sleep_s"] + v["vllm_wake_s"] + gb / 2 * v["vllm_wake_s_per_gb"])
                  * (1 + 7 * v["vllm_rank_sync_factor"]))
    assert base["phases"]["sleep_wake"] == pytest.approx(sleep_wake, rel=1e-3) and lev["phases"]["sleep_wake"] == 0.0
    assert base["step_s"] - lev["step_s"] == pytest.approx(base["phases"]["old_log_prob"] + sleep_wake, rel=1e-3)
    # split placement has no sleep to skip
    split = scaling.Layout("s", 8, "split", tp=2, pp=1, rollout_tp=2, train_gpus=4, rollout_gpus=4)
    assert scaling.step("qwen3-4b", split, scaling.Recipe(free_cache_engine=False), inp, cal)["phases"][
        "sleep_wake"] == 0.0
