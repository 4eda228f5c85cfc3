"""User mistakes end with a clear message: missing model, malformed data row, a raising reward, a NaN loss."""

import json
import os

import pytest

from rltrain.trainer.ppo import TrainingDiverged, run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(600)


def test_missing_model_path_names_the_key(tmp_path, cfg_for):
    cfg = cfg_for("model.builtin=null", f"model.path={tmp_path}/no_such_model", "model.tokenizer=char")
    with pytest.raises(FileNotFoundError, match="model.path"):
        run_from_config(cfg, str(tmp_path / "run"))


def test_malformed_data_row_names_file_line_and_key(tmp_path, cfg_for):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "12=", "answer": "2"}, {"prompt": "34=", "answer": "4"}, {"question": "56=", "answer": "6"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = cfg_for("data.source=file", f"data.train_files=[{data}]", "reward.fn=synthetic")
    with pytest.raises(ValueError) as info:
        run_from_config(cfg, str(tmp_path / "run"))
    msg = str(info.value)
    assert "train.jsonl" in msg and "3" in msg and "prompt" in msg


def test_raising_reward_is_counted_and_scored_zero(tmp_path, ray_session, cfg_for):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def reward(response, ground_truth, **kw):\n"
                  "    if int(ground_truth) % 2 == 0:\n"
                  "        raise RuntimeError('boom')\n"
                  "    return 0.5\n")
    run_dir = str(tmp_path / "run")
    cfg = cfg_for(f"reward.fn={fn}:reward", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # rows with an even answer raised: counted, scored 0; the others scored 0.5
        assert r["reward/errors"] > 0
        assert r["critic/score/min"] == 0.0 and r["critic/score/max"] == 0.5


def test_nan_loss_stops_without_overwriting_last_good_checkpoint(tmp_path, ray_session, cfg_for):
    est = tmp_path / "nan_adv.py"
    est.write_text(
        "import os\n"
        "from rltrain.algorithms import compute_advantages\n"
        "MARK = os.path.join(os.path.dirname(__file__), 'called_once')\n"
        "def adv(token_rewards, response_mask, **kw):  # fine at step 1, NaN from step 2 on\n"
        "    a, r = compute_advantages('grpo', token_rewards, response_mask, group_ids=kw['group_ids'])\n"
        "    if os.path.exists(MARK):\n"
        "        a = a * float('nan')\n"
        "    open(MARK, 'w').close()\n"
        "    return a, r\n")
    run_dir = str(tmp_path / "run")
    cfg = cfg_for(f"algorithm.adv_estimator={est}:adv", "trainer.total_steps=3", "trainer.save_freq=1",
                  "trainer.test_freq=-1", "trainer.logger=[jsonl]")
    with pytest.raises(TrainingDiverged, match="step 2"):
        from rltrain.trainer.ppo import PPOTrainer

        from rltrain.trainer.setup import config_dict
        PPOTrainer(config_dict(cfg), run_dir).fit()
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ckpts == ["step_1"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
