"""The allowed names config/validate.py states itself because config/ may not import their owner (tests/
test_architecture.py: config-no-runtime) agree with what the owner accepts."""

from __future__ import annotations

import json

import pytest
import torch

from rltrain.config.validate import DATA_SOURCES, TRAINER_DEVICES, MODEL_DTYPES, PLAN_CHECKS
from rltrain.config.entry import compose_config as compose


def test_devices_are_what_the_trainer_resolves():
    from rltrain.workers.hybrid import resolve_device

    for name in TRAINER_DEVICES:
        if name == "cuda" and not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="trainer.device=cuda"):
                resolve_device(name)
        else:
            assert resolve_device(name) in ("cpu", "cuda")


def test_model_dtypes_are_torch_dtypes_the_planner_sizes_alike():
    from rltrain.plan.inputs import read

    for name in MODEL_DTYPES:
        dtype = getattr(torch, name)  # as workers/hybrid.py and trainer/sft.py read model.dtype
        assert isinstance(dtype, torch.dtype)
        x = read(compose("grpo_tiny", [f"model.dtype={name}"]))
        assert x.dtype_bytes == torch.empty(0, dtype=dtype).element_size()


def test_every_data_source_is_built(tmp_path):
    from rltrain.trainer.setup import build_datasets

    rows = tmp_path / "train.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1"}], "answer": str(i + 1)})
                              for i in range(4)) + "\n")
    overrides = {"synthetic": ["data.source=synthetic"],
                 "file": ["data.source=file", f"data.train_files=[{rows}]", "data.train_batch_size=2"]}
    assert set(overrides) == set(DATA_SOURCES)
    for source in DATA_SOURCES:
        _, train, _, _, _ = build_datasets(compose("grpo_tiny", overrides[source]))
        assert len(train) > 0, source


def test_every_plan_check_mode_is_handled_on_cpu():
    from rltrain.trainer.setup import plan_check

    for mode in PLAN_CHECKS:
        assert plan_check(compose("grpo_tiny", [f"trainer.plan_check={mode}"])) is None  # a CPU run plans nothing
