"""What a run exposes to other local users while it runs: the TCP sockets its processes listen on (read from
/proc/net/tcp{,6} and each process's fds, polled), fake secrets placed in its environment (WANDB_API_KEY, HF_TOKEN)
found on any process's command line or in the files of Ray's sessions started meanwhile, and the mode of Ray's token
file. Linux only. The instrument of tests/trainer/test_shared_host.py (and tests/workers/test_rendezvous.py); on a GPU
machine, from the repository's root:

  python tests/trainer/exposure.py --out exposure.json -- python -m rltrain.main --config-name grpo_tiny \\
      trainer.total_steps=2 hydra.run.dir=/tmp/exposure_run

Prints a JSON report (also to --out); exit 0 when the command succeeded, every listener was on loopback and no secret
was found, else 1.
"""

from __future__ import annotations

import argparse
import glob
import ipaddress
import json
import os
import secrets
import stat
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

from harness.procs import label, pids  # noqa: E402  (tools/harness: a process's label)

SECRET_VARS = ("WANDB_API_KEY", "HF_TOKEN")


def _tree(root: int) -> set[int]:
    """`root` and all its descendants now."""
    kids: dict[int, list[int]] = {}
    for pid in pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                kids.setdefault(int(f.read().rsplit(b")", 1)[1].split()[1]), []).append(pid)
        except (OSError, IndexError, ValueError):
            continue
    todo, seen = [root], set()
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo += kids.get(p, [])
    return seen


def listening() -> dict[str, str]:
    """socket inode -> 'address:port' of every TCP socket in LISTEN state on this host (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":
                    continue
                hexaddr, hexport = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words, little-endian
                out[fields[9]] = f"{ipaddress.ip_address(raw)}:{int(hexport, 16)}"
    return out


def sockets(pid: int) -> set[str]:
    """The socket inodes among `pid`'s open files."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    out = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd, for one)
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _cmdlines() -> str:
    parts = []
    for pid in pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                parts.append(f.read().decode(errors="replace"))
        except OSError:
            continue
    return "\n".join(parts)


def _ray_token() -> tuple[str | None, str | None]:
    """(Ray's token, its file's mode) from RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; (None, None) without one."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        return f.read().strip() or None, f"{stat.S_IMODE(os.stat(path).st_mode):04o}"


def _in_files(roots: list[str], needles: dict[str, str]) -> list[str]:
    """'path: name' for each needle (name -> value) found in a file under `roots`."""
    found = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                found += [f"{path}: {k}" for k, v in needles.items() if v and v.encode() in data]
    return found


def watch(commands: dict[str, list[str]], *, cwd: str | None = None, env: dict | None = None, poll_s: float = 0.5,
          timeout_s: float = 900) -> dict:
    """Run `commands` (name -> argv) at once with fake secrets in their environment and watch them until they end.
    Returns {"runs": {name: {"returncode", "stderr_tail", "listeners": {"pid label": [addresses]}}},
    "secrets_on_command_lines", "secrets_in_ray_sessions", "ray_sessions", "ray_token_mode"}."""
    fake = {name: f"{name.lower()}{secrets.token_hex(12)}" for name in SECRET_VARS}
    env = {**(os.environ if env is None else env), **fake}
    started, procs = time.time(), {}
    for name, argv in commands.items():
        log = tempfile.TemporaryFile("w+")
        procs[name] = (subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log,
                                        start_new_session=True), log)
    seen: dict[str, dict[str, set]] = {name: {} for name in procs}
    on_cmdline: set[str] = set()
    try:
        while any(p.poll() is None for p, _ in procs.values()) and time.time() < started + timeout_s:
            table = listening()
            for name, (proc, _) in procs.items():
                for pid in _tree(proc.pid):
                    for inode in sockets(pid) & table.keys():
                        seen[name].setdefault(f"{pid} {label(pid)}", set()).add(table[inode])
            text = _cmdlines()
            on_cmdline |= {k for k, v in fake.items() if v in text}
            time.sleep(poll_s)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait()
    token, mode = _ray_token()
    sessions = [d for d in glob.glob(os.path.join(tempfile.gettempdir(), "ray", "session_*"))
                if not os.path.islink(d) and os.path.getmtime(d) >= started - 5]
    runs = {}
    for name, (proc, log) in procs.items():
        log.seek(0)
        runs[name] = {"returncode": proc.returncode, "stderr_tail": log.read()[-3000:],
                      "listeners": {who: sorted(a) for who, a in seen[name].items()}}
        log.close()
    return {"runs": runs, "secrets_on_command_lines": sorted(on_cmdline), "ray_sessions": sessions,
            "secrets_in_ray_sessions": _in_files(sessions, {**fake, "RAY_AUTH_TOKEN": token}),
            "ray_token_mode": mode}


def problems(report: dict) -> list[str]:
    """What in a watch() report another local user could use: non-loopback listeners, secrets found, a failed run,
    a Ray token file others can read."""
    out = []
    for name, run in report["runs"].items():
        if run["returncode"] != 0:
            out.append(f"{name}: exit {run['returncode']}")
        out += [f"{name}: {who} listens on {a}" for who, addrs in run["listeners"].items() for a in addrs
                if not is_loopback(a)]
    out += [f"{k} on a command line" for k in report["secrets_on_command_lines"]]
    out += [f"in Ray's session files: {hit}" for hit in report["secrets_in_ray_sessions"]]
    if report["ray_token_mode"] not in (None, "0600", "0400"):
        out.append(f"Ray's token file has mode {report['ray_token_mode']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the JSON report here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to watch after --")
    report = watch({"run": command})
    report["problems"] = problems(report)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
