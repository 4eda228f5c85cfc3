"""PromptDataset (jsonl/parquet, malformed rows, length filter, chat template), PromptSampler resume,
repeat_for_groups, and rltrain.data.prepare's converters against the shipped samples."""

import json
import logging
from pathlib import Path

import pytest

from rltrain.data import prepare
from rltrain.data.dataset import PromptDataset, PromptSampler, read_rows, repeat_for_groups, write_rows
from rltrain.data.tokenizer import CharTokenizer

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def dataset(path, **kw):
    args = dict(prompt_key="prompt", answer_key="answer", data_source_key="data_source", tokenizer=CharTokenizer(),
                max_prompt_length=1024, apply_chat_template=True)
    args.update(kw)
    return PromptDataset(path, **args)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_gsm8k_sample_jsonl_loads_with_chat_template():
    ds = dataset(HERE / "gsm8k_sample.jsonl")
    tok = CharTokenizer()
    raw = [json.loads(line) for line in (HERE / "gsm8k_sample.jsonl").read_text().splitlines()]
    assert len(ds) == 3 and [it["ground_truth"] for it in ds] == ["172", "2000", "2.25"]
    for item, row in zip(ds, raw):
        expected = "<bos><|user|>" + row["prompt"][0]["content"].lower() + "<|end|><|assistant|>"
        assert tok.decode(item["prompt_ids"], skip_special_tokens=False) == expected
        assert item["prompt"] == tok.apply_chat_template(row["prompt"])
        assert item["data_source"] == "openai/gsm8k" and item["extra"]["split"] == "train"


def test_dapo_sample_parquet_loads():
    ds = dataset(HERE / "dapo_math_sample.parquet")
    assert [it["ground_truth"] for it in ds] == ["28", "17"]
    assert all(it["data_source"] == "math_dapo" and "\\boxed{}" in it["prompt"] for it in ds)


def test_system_prompt_and_raw_prompts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2, "data_source": "toy"}])
    with_sys = dataset(path, system_prompt="add")
    assert with_sys[0]["prompt"] == "<bos><|system|>add<|end|><|user|>1+1=<|end|><|assistant|>"
    raw = dataset(path, apply_chat_template=False)
    assert raw[0]["prompt"] == "1+1=" and raw[0]["prompt_ids"] == CharTokenizer().encode("1+1=", add_special_tokens=True)
    assert raw[0]["ground_truth"] == "2"  # numbers become strings


def test_dotted_keys_read_verl_style_rows(tmp_path):
    path = write_jsonl(tmp_path / "v.jsonl", [{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "7"}}])
    ds = dataset(path, answer_key="reward_model.ground_truth", data_source_key=None)
    assert ds[0]["ground_truth"] == "7" and ds[0]["data_source"] == "v"


@pytest.mark.parametrize("bad_row,key,message", [
    ({"prompt": "q", "data_source": "s"}, "answer", "missing key 'answer'"),
    ({"prompt": "q", "answer": ["1"], "data_source": "s"}, "answer", "must be a string or number"),
    ({"prompt": 5, "answer": "1", "data_source": "s"}, "prompt", "must be a string or a non-empty list"),
    ({"prompt": [{"role": "user"}], "answer": "1", "data_source": "s"}, "prompt", "string 'role' and 'content'"),
    ({"prompt": "q", "answer": "1", "data_source": 5}, "data_source", "data_source"),
])
def test_malformed_jsonl_row_names_file_line_and_key(tmp_path, bad_row, key, message):
    good = {"prompt": "q", "answer": "1", "data_source": "s"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_row])
    with pytest.raises(ValueError) as e:
        dataset(path)
    assert f"{path}:3" in str(e.value) and repr(key) in str(e.value) and message in str(e.value)


def test_missing_data_source_falls_back_to_the_file_name(tmp_path):
    path = write_jsonl(tmp_path / "mydata.jsonl", [{"prompt": "q", "answer": "1"}])
    assert dataset(path)[0]["data_source"] == "mydata"


def test_invalid_json_line_is_reported_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "answer": "1", "data_source": "s"}, "{not json"])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        dataset(path)


def test_malformed_parquet_row_names_file_row_and_key(tmp_path):
    path = tmp_path / "bad.parquet"
    write_rows([{"prompt": "q", "answer": "1", "data_source": "s"}, {"prompt": "q", "answer": None, "data_source": "s"}], path)
    with pytest.raises(ValueError, match=r"bad.parquet:2: key 'answer' must be a string or number"):
        dataset(path)


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        dataset(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        dataset(tmp_path / "x.csv")


def test_long_prompts_are_dropped_counted_and_logged(tmp_path, caplog):
    rows = [{"prompt": "x" * n, "answer": "1", "data_source": "s"} for n in (3, 30, 5, 40)]
    path = write_jsonl(tmp_path / "len.jsonl", rows)
    # raw prompt with <bos>: length = n + 1
    with caplog.at_level(logging.WARNING):
        ds = dataset(path, apply_chat_template=False, max_prompt_length=10)
    assert len(ds) == 2 and ds.num_dropped == 2
    assert [it["index"] for it in ds] == [0, 2]
    assert "dropped 2 of 4" in caplog.text
    with pytest.raises(ValueError, match="no prompts left"):
        dataset(path, apply_chat_template=False, max_prompt_length=2)


def test_write_and_read_rows_round_trip_both_formats(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "a"}], "answer": "1", "data_source": "s", "extra_info": {"k": 1}}]
    for name in ("r.jsonl", "r.parquet"):
        write_rows(rows, tmp_path / name)
        assert [r for _, r in read_rows(tmp_path / name)] == rows


def test_sampler_is_deterministic_covers_each_epoch_and_resumes():
    data = list(range(10))
    a = PromptSampler(data, batch_size=3, seed=7)
    first = [a.next_indices() for _ in range(3)]  # one epoch: 3 batches of 3, one index left out
    assert len(set(sum(first, []))) == 9
    b = PromptSampler(data, batch_size=3, seed=7)
    assert [b.next_indices() for _ in range(3)] == first
    c = PromptSampler(data, batch_size=3, seed=8)
    assert [c.next_indices() for _ in range(3)] != first
    # resume mid-epoch 1
    for _ in range(2):
        a.next_indices()
    state = a.state_dict()
    assert state["epoch"] == 1 and state["position"] == 2
    resumed = PromptSampler(data, batch_size=3, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [resumed.next_indices() for _ in range(5)] == [a.next_indices() for _ in range(5)]
    assert a.next_batch() == [data[i] for i in resumed.next_indices()]
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(data, batch_size=11, seed=0)


def test_repeat_for_groups_hand_example():
    prompts, group_ids = repeat_for_groups(["a", "b", "c"], 2, group_offset=10)
    assert prompts == ["a", "a", "b", "b", "c", "c"]
    assert group_ids.tolist() == [10, 10, 11, 11, 12, 12]
    with pytest.raises(ValueError, match="rollout.n"):
        repeat_for_groups(["a"], 0)


def test_prepare_gsm8k_converts_raw_rows_into_the_shipped_sample():
    raw = json.loads((HERE / "gsm8k_raw_sample.json").read_text())
    converted = [prepare.gsm8k_row(r, i, "train") for i, r in enumerate(raw)]
    assert converted == [r for _, r in read_rows(HERE / "gsm8k_sample.jsonl")]
    assert converted[1]["answer"] == "2000"  # "#### 2,000" loses its comma
    with pytest.raises(ValueError, match="####"):
        prepare.gsm8k_row({"question": "q", "answer": "no marker"}, 0, "train")


def test_prepare_dapo_math_dedupes_and_rewrites_the_prompt():
    raw = json.loads((HERE / "dapo_math_raw_sample.json").read_text())
    converted = prepare.dapo_rows(raw)
    assert converted == [r for _, r in read_rows(HERE / "dapo_math_sample.parquet")]
    assert len(converted) == 2 and "Answer:" not in converted[0]["prompt"][0]["content"]
    assert prepare.dapo_rows(raw, keep_prompt=True)[0]["prompt"][0]["content"] == raw[0]["prompt"][0]["content"]


def test_prepare_gsm8k_offline_from_a_local_copy_writes_what_the_config_reads(tmp_path, monkeypatch):
    """The raw split files in a directory (as the Hub lays them out) -> the parquet files configs/data/gsm8k.yaml
    names, readable as the trainer reads them; no network touched (offline mode set)."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = json.loads((HERE / "gsm8k_raw_sample.json").read_text())
    write_rows(raw[:2], tmp_path / "raw" / "main" / "train-00000-of-00001.parquet")
    write_rows(raw[2:], tmp_path / "raw" / "main" / "test-00000-of-00001.parquet")
    monkeypatch.chdir(tmp_path)
    prepare.main(["gsm8k", "--from", str(tmp_path / "raw")])
    cfg = OmegaConf.load(REPO / "configs" / "data" / "gsm8k.yaml")
    files = [*cfg.train_files, *cfg.val_files]
    assert files == ["data/gsm8k/train.parquet", "data/gsm8k/test.parquet"]
    got = [[r for _, r in read_rows(tmp_path / f)] for f in files]
    want = [r for _, r in read_rows(HERE / "gsm8k_sample.jsonl")]
    assert [r["answer"] for r in got[0] + got[1]] == [r["answer"] for r in want]
    assert got[0] == [prepare.gsm8k_row(r, i, "train") for i, r in enumerate(raw[:2])]
    assert len(dataset(tmp_path / files[1])) == len(raw) - 2


@pytest.mark.parametrize("argv, says", [
    (["gsm8k"], "rerun this command with --from <that file"),  # offline, nothing cached: how to run from a local copy
    (["gsm8k", "--from", "nowhere.parquet", "--splits", "train"], "--from nowhere.parquet: no such file"),
    (["gsm8k", "--from", "one.json"], "is one file: name its split"),
    (["dapo_math", "--from", "one.json"], "not the raw rows expected"),
])
def test_prepare_offline_mistakes_exit_2_with_the_fix(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.json").write_text('[{"question": "q"}]')
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *a, **k):  # as on a machine without `datasets`: the hub client path
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(SystemExit) as stop:
        prepare.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and not (tmp_path / "data").exists()


def test_prepare_dapo_math_offline_writes_both_files_the_config_reads(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = json.loads((HERE / "dapo_math_raw_sample.json").read_text())
    write_rows(raw, tmp_path / "dapo-math-17k.parquet")
    monkeypatch.chdir(tmp_path)
    prepare.main(["dapo_math", "--from", "dapo-math-17k.parquet"])
    prepare.main(["dapo_math", "--set", "aime2024", "--from", "dapo-math-17k.parquet", "--max-rows", "1"])
    cfg = OmegaConf.load(REPO / "configs" / "data" / "dapo_math.yaml")
    train, val = cfg.train_files[0], cfg.val_files[0]
    assert [r for _, r in read_rows(tmp_path / train)] == [r for _, r in read_rows(HERE / "dapo_math_sample.parquet")]
    assert len(read_rows(tmp_path / val)) == 1


def test_a_missing_recipe_data_file_names_the_command_that_makes_it(tmp_path, monkeypatch):
    from rltrain.data.dataset import DataError

    monkeypatch.chdir(tmp_path)
    made = {"data/retool_tiny/sft.jsonl": "python -m rltrain.data.retool_synthetic --out data/retool_tiny",
            "data/gsm8k/train.parquet": "python -m rltrain.data.prepare gsm8k",
            "./data/dapo_math/aime2024.parquet": "python -m rltrain.data.prepare dapo_math --set aime2024"}
    for path, command in made.items():
        with pytest.raises(DataError, match=f"make it with `{command}`"):
            read_rows(path)
    with pytest.raises(DataError, match="does not exist; fix the path in data.train_files") as err:
        read_rows("mine/rows.jsonl")
    assert "make it" not in str(err.value)
