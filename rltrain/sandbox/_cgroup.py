"""Per-call memory and process accounting with cgroups (parent side; the child joins what is made here).

Where this process may create cgroups (cgroup v2 with the memory and pids controllers enabled for its
cgroup's children, else the v1 memory and pids hierarchies), each call gets its own cgroup(s): memory
limit = memory_mb for everything the call's processes use together (their pages, and the files in their
tmpfs), pids limit = its processes. The kernel OOM-kills inside the cgroup when the sum goes over; the
parent reads the kill count to report status "memory". Where neither is possible the limits are per
process (rlimits): each process at most memory_mb of address space, at most max_processes processes, so
the sum is bounded by memory_mb x max_processes; `describe()` says which holds.
"""

from __future__ import annotations

import functools
import os
import time

_PREFIX = "rltrain-sandbox-"
_orphans: list[str] = []  # cgroups whose removal failed (still busy); retried by later calls


def _own_cgroups() -> dict[str, str]:
    """hierarchy ("" for v2, else the v1 controller list) -> this process's cgroup path in it."""
    found = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            found[controllers] = path
    return found


def _mounts() -> dict[str, str]:
    """"cgroup2" or a v1 controller name -> its mount point."""
    found = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = (right.split() + ["", "", ""])[:3]
            mount_point = left.split()[4]
            if fstype == "cgroup2":
                found.setdefault("cgroup2", mount_point)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    if opt in ("memory", "pids"):
                        found.setdefault(opt, mount_point)
    return found


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK)


@functools.lru_cache(maxsize=1)
def detect() -> tuple[str, tuple[str, ...], str]:
    """(kind, parent dirs, why not): kind "v2" (one parent), "v1" (memory, pids parents) or "" (none)."""
    try:
        own, mounts = _own_cgroups(), _mounts()
    except OSError as e:
        return "", (), "cannot read /proc/self/cgroup or mountinfo (%s)" % e
    if "cgroup2" in mounts and "" in own:
        parent = os.path.join(mounts["cgroup2"], own[""].lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            enabled = []
        if {"memory", "pids"} <= set(enabled) and _writable_dir(parent):
            return "v2", (parent,), ""
    v1 = []
    for controller in ("memory", "pids"):
        path = next((p for c, p in own.items() if controller in c.split(",")), None)
        if controller not in mounts or path is None:
            return "", (), "no cgroup v2 with memory+pids delegated, and no v1 %s hierarchy" % controller
        v1.append(os.path.join(mounts[controller], path.lstrip("/")))
    if not all(_writable_dir(p) for p in v1):
        return "", (), "the cgroups of this process are not writable (%s)" % ", ".join(v1)
    return "v1", tuple(v1), ""


def create(sandbox_id: str, memory_mb: int, max_processes: int) -> tuple[list[str], str]:
    """Make the call's cgroup(s); (their dirs, description of the limits in force). Never raises."""
    _retry_orphans()
    kind, parents, why_not = detect()
    if not kind:
        return [], "per-process (rlimits: %d MiB each, %d processes; no cgroup: %s)" % (
            memory_mb, max_processes, why_not)
    made = []
    try:
        for parent in parents:
            d = os.path.join(parent, _PREFIX + sandbox_id)
            os.mkdir(d)
            made.append(d)
        limit = str(memory_mb * 2**20)
        procs = str(max_processes + 2)  # + the bootstrap and the reaper
        if kind == "v2":
            _write(made[0], "memory.max", limit)
            _write(made[0], "memory.swap.max", "0", optional=True)
            _write(made[0], "pids.max", procs)
        else:
            _write(made[0], "memory.limit_in_bytes", limit)
            _write(made[0], "memory.memsw.limit_in_bytes", limit, optional=True)
            _write(made[1], "pids.max", procs)
    except OSError as e:
        remove(made)
        return [], "per-process (rlimits: %d MiB each, %d processes; cgroup %s failed: %s)" % (
            memory_mb, max_processes, kind, e)
    return made, "cgroup-%s(memory %d MiB, pids %s per call)" % (kind, memory_mb, procs)


def _write(d, name, value, optional=False):
    try:
        with open(os.path.join(d, name), "w") as f:
            f.write(value)
    except OSError:
        if not optional:
            raise


def oom_killed(dirs: list[str]) -> bool:
    """Whether the kernel killed a process of the call for exceeding its memory limit. Never raises."""
    for d in dirs:
        for name in ("memory.events", "memory.oom_control"):
            try:
                with open(os.path.join(d, name)) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and value.strip() not in ("", "0"):
                            return True
            except OSError:
                continue
    return False


def remove(dirs: list[str], wait_s: float = 1.0) -> None:
    """rmdir the call's cgroups (their processes are dead or dying); what stays busy is retried later."""
    deadline = time.monotonic() + wait_s
    for d in dirs:
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    _orphans.append(d)
                    break
                time.sleep(0.01)


def _retry_orphans() -> None:
    for d in list(_orphans):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        try:
            _orphans.remove(d)
        except ValueError:
            pass
