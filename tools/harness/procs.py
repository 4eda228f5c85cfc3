"""Processes of this machine from Linux's /proc (tools/run_exposure.py): their ids, and a short label for each (a Ray
actor by its class, a Python program by its module or script). Empty answers elsewhere."""

from __future__ import annotations

import os


def pids() -> list[int]:
    """Every process id /proc lists now."""
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def label(pid: int | str) -> str:
    """A short name for a running process (label_of its command line); "?" when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    return label_of(argv)


def label_of(argv: list[str]) -> str:
    """`ray::HybridWorker` for a Ray actor (Ray sets its title to `ray::Class.method`), `python -m rltrain.main` or
    `python gpu_placements.py` for Python (its options before the module or script skipped), else the program's
    base name; "?" for an empty command line (a kernel thread)."""
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0].split(".")[0]
    prog = os.path.basename(argv[0].split()[0])
    if not prog.startswith("python"):
        return prog
    rest = list(argv[1:])
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]  # those two take a value
    if len(rest) >= 2 and rest[0] == "-m":
        return f"python -m {rest[1]}"
    if rest and rest[0] == "-c":
        return "python -c"
    return f"python {os.path.basename(rest[0])}" if rest else prog
