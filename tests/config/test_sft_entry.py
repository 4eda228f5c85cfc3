"""rltrain.sft's config gate (#32): like rltrain.main, a wrong type or an unknown key of the SFT schema prints one
line naming the key and exits 2 (Hydra alone exits 1 with a traceback hint), before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_sft(*args, run_dir):
    return subprocess.run([sys.executable, "-m", "rltrain.sft", "--config-name", "retool_tiny_sft", *args,
                           f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("override,key", [("optim.lr=abc", "optim.lr"), ("trainer.epochs=two", "trainer.epochs"),
                                          ("+optim.foo=1", "optim.foo"), ("data.max_lenght=64", "data.max_lenght"),
                                          ("+actor.lr=1e-5", "actor")])
def test_sft_cli_wrong_type_or_unknown_key_exits_2_naming_the_key(override, key, tmp_path):
    res = _run_sft(override, run_dir=tmp_path / "run")
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("rltrain: ") and key in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run directory
