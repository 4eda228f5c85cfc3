"""Processes of this machine from Linux's /proc: their ids, and a short label for each (a Ray actor by its class, a
Python program by its module or script; tests/trainer/exposure.py), and what tools/gpu_placements.py asks of a run's
processes: Ray's workers, their stacks, each one's last log lines, the log's multi-GPU safety lines. Empty answers
elsewhere."""

from __future__ import annotations

import os
import re

_PROCESS_PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\((\w+) pid=(\d+)\)")


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


def log_checks(text: str) -> dict:
    """What a run's log says about multi-GPU safety: NVLink multicast must never appear (hosts are shared)."""
    lines = text.splitlines()
    return {"mnnvl_lines": [ln[:200] for ln in lines if "mnnvl" in ln.lower()][:5],
            "pynccl_all_reduce": any("Using ['PYNCCL'] all-reduce backends" in ln for ln in lines)}


def ray_worker_pids() -> list[int]:
    """This machine's rltrain Ray workers (Ray names an actor's process `ray::<class>`)."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::HybridWorker"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def dump_stacks(pids: list[int]) -> int:
    """Ask each process for its Python stacks (rltrain/utils/stacks.py: SIGUSR1); returns how many were asked."""
    from rltrain.utils.stacks import STACK_DUMP_SIGNAL

    asked = 0
    for pid in pids:
        try:
            os.kill(pid, STACK_DUMP_SIGNAL)
            asked += 1
        except (OSError, TypeError):
            continue
    return asked


def process_tails(text: str, lines: int = 40) -> dict[str, str]:
    """The last `lines` lines of the driver and of each Ray process (Ray prefixes a worker's lines with
    `(Class pid=N)`) of a failed run: which rank stopped where, even when another rank's output fills the tail."""
    per: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _PROCESS_PREFIX.match(line)
        per.setdefault(f"{m.group(1)} pid={m.group(2)}" if m else "driver", []).append(line)
    return {k: "\n".join(v[-lines:]) for k, v in per.items()}
