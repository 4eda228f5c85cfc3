"""tools/driver_gil_bench.py: its cases run (awkward sizes: rows not a multiple of the ranks, one row), every time is
positive, the driver's hand-off is restored after; bad input exits 2."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import driver_gil_bench  # noqa: E402


def test_cases_run_and_the_hand_off_is_restored(tmp_path, capsys):
    before = sys.getswitchinterval()
    out = tmp_path / "r.json"
    assert driver_gil_bench.main(["--rows", "7", "--dp", "2", "3", "--repeats", "2", "--json", str(out)]) == 0
    assert sys.getswitchinterval() == before
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["split dp=2 (Batch.split)", "gather dp=2 (torch.cat)",
                                         "split dp=3 (Batch.split)", "gather dp=3 (torch.cat)"]
    assert all(r[k] > 0 for r in rows for k in ("alone_ms", "busy_5ms_ms", "busy_driver_ms"))
    assert "| split dp=3 (Batch.split) |" in capsys.readouterr().out
    assert driver_gil_bench.main(["--rows", "1", "--dp", "1", "--repeats", "1"]) == 0


def test_bad_input_exits_2(capsys):
    assert driver_gil_bench.main(["--rows", "0"]) == 2
    assert "--rows must be >= 1" in capsys.readouterr().err
    assert driver_gil_bench.main(["--rows", "4", "--dp", "5"]) == 2
    assert "--dp must be in [1, --rows 4]" in capsys.readouterr().err
