"""The run directory's life: one live run per directory (an OS lock), and finding the run a resume continues.

Must not train or read model files: it only checks and locks directories, reads run dirs' config.json and asks
utils/checkpoint.py which checkpoints are intact.

- `prepare_run_dir(dir)`: before anything is written there (Hydra's files included), the run directory is made
  (mode 0755) and refused when another local user owns or can write it, a file rltrain or Hydra writes there is a
  link, or it is read-only (one line, exit 2; utils/safefs.py has the rule).
- `lock_run_dir(dir)`: an exclusive `fcntl.flock` on `<real path of dir>/.rltrain.lock`, held for the process's
  life (the kernel drops it when the process dies, however it dies). A second run on the same directory, or on a
  link to it, gets a `RunDirLocked` (a UserError: exit 2) naming the holder's pid and command. The checkpoint
  directory is locked the same way (`claim_checkpoint_dir`).
- `find_previous_run(...)`: `trainer.resume=auto` on the command line without hydra.run.dir continues the newest
  sibling of the fresh Hydra run dir (`outputs/<experiment>/<time>`) of the same experiment that has an intact
  checkpoint, in that run's directory (config/entry.py pins it) or, with trainer.resume_in_place=false, in the
  fresh one.
- `resume_command(run_dir)`: the exact command that continues a stopped run in its own directory.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from rltrain.utils.errors import UserError
from rltrain.utils.safefs import check_private_dir, make_dirs, open_nofollow, unwritable_reason, write_text

LOCK_FILE = ".rltrain.lock"
FINISHED_FILE = ".rltrain_finished"  # written when a run ends normally: a finished run is not resumed by others
# what rltrain and Hydra write at the top of a run directory (besides `<job>.log` and the plots, utils/plotting.PLOTS):
# none may be a link (safefs.check_private_dir)
RUN_FILES = (LOCK_FILE, FINISHED_FILE, "config.json", "metrics.jsonl", ".hydra", "wandb", "checkpoints", "hf",
             "profile")
_held: dict[str, int] = {}  # realpath -> fd of the locks this process holds (kept open: the lock lives with it)


class RunDirLocked(UserError, RuntimeError):
    """Another live run holds the directory."""


class RunDirError(UserError, OSError):
    """A run directory that cannot be created or written (read-only, a file in its place)."""


def run_dir_names(job: str = "main") -> tuple[str, ...]:
    """The names at the top of a run directory that must not be links: RUN_FILES, Hydra's `<job>.log`, the plots."""
    from rltrain.utils.plotting import PLOTS
    from rltrain.utils.tracking import WANDB_ID_FILE

    return (*RUN_FILES, WANDB_ID_FILE, "metrics.jsonl.tmp", f"{job}.log", *PLOTS)


def prepare_run_dir(path: str, job: str = "main") -> str:
    """Create the run directory `path` (new directories get mode 0755) and check it before anything is written there
    (Hydra's .hydra/ and log included): no other local user owns or can write it (UnsafePathError), none of
    run_dir_names(job) in it is a link, and files can be created in it (RunDirError). Returns its real path."""
    key = "hydra.run.dir"
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"the run directory {path} is a file, not a directory; remove it or set {key}=<a directory>")
    try:
        make_dirs(path)
    except OSError as err:
        raise RunDirError(f"cannot create the run directory {path} ({err.strerror or err}); set {key} to a writable "
                          "directory") from None
    real = check_private_dir(path, what="run directory", key=key, names=run_dir_names(job))
    why = unwritable_reason(real)
    if why is not None:
        raise RunDirError(f"the run directory {path} is not writable ({why}); set {key} to a writable directory")
    return real


def _holder(lock_path: str) -> str:
    try:
        with open_nofollow(lock_path) as f:
            info = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return "another process"
    pid, cmd = info.get("pid"), info.get("command")
    return f"pid {pid}" + (f" ({cmd})" if cmd else "") if pid else "another process"


def lock_run_dir(path: str, what: str = "run directory", key: str = "hydra.run.dir",
                 upto: str | None = None) -> str | None:
    """Take the exclusive lock of `path` (created if missing) for this process's life; return the lock file,
    or None where the file system has no locks (a warning says so). RunDirLocked when a live run holds it. The lock
    is on the directory's real path, so a link to a live run's directory meets its lock; the directory is checked
    first (safefs.check_private_dir: this user's, writable by no one else; parents up to `upto`)."""
    import fcntl

    make_dirs(path)
    real = check_private_dir(path, what=what, key=key, upto=upto, names=(LOCK_FILE, FINISHED_FILE))
    if real in _held:
        return os.path.join(real, LOCK_FILE)
    lock_path = os.path.join(real, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        print(f"rltrain: warning: cannot create the lock file {lock_path} ({err.strerror}); two runs on this "
              f"{what} would not be stopped", file=sys.stderr, flush=True)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        shown = path if os.path.abspath(path) == real else f"{path} ({real})"
        raise RunDirLocked(
            f"the {what} {shown} is in use by a live run, {_holder(lock_path)}; two runs there would interleave "
            f"their metrics and overwrite each other's checkpoints. Wait for it to end (or stop it), or give this "
            f"run another directory ({key}=...)") from None
    except OSError as err:  # e.g. ENOLCK on a network file system without locks
        os.close(fd)
        print(f"rltrain: warning: cannot lock {lock_path} ({err.strerror}); two runs on this {what} would not be "
              "stopped", file=sys.stderr, flush=True)
        return None
    info = json.dumps({"pid": os.getpid(), "command": " ".join(shlex.quote(a) for a in _argv())[:500]})
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    _held[real] = fd
    try:
        os.remove(os.path.join(real, FINISHED_FILE))  # running again: not finished until this run is
    except OSError:
        pass
    return lock_path


def claim_checkpoint_dir(ckpt_dir: str, run_dir: str, *, save: bool) -> None:
    """At the start of a run, before the trainer is built: the checkpoint directory is checked writable when the run
    saves (checkpoint.check_writable), locked by its real path when it exists (lock_run_dir: a second run given a
    link to a live run's checkpoints is refused; another user's or a shared writable one is refused), and cleared of
    crashed runs' temp dirs under that lock. One rule for the RL trainer and SFT (rank 0)."""
    from rltrain.utils.checkpoint import check_writable, clean_stale_tmp

    if save:
        check_writable(ckpt_dir)
    if os.path.isdir(ckpt_dir):
        lock_run_dir(ckpt_dir, what="checkpoint directory", key="trainer.ckpt_dir", upto=run_dir)
    clean_stale_tmp(ckpt_dir)


def is_locked(path: str) -> bool:
    """Whether a live process (other than this one) holds `path`'s run lock."""
    import fcntl

    if os.path.realpath(path) in _held:
        return False
    lock_path = os.path.join(os.path.realpath(path), LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the shared lock taken to probe
    return False


def _argv() -> list[str]:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("rltrain/main.py", "rltrain/sft.py")):
        argv = [sys.executable, "-m", "rltrain." + os.path.splitext(os.path.basename(argv[0]))[0], *argv[1:]]
    elif argv and argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    return argv


def resume_command(run_dir: str) -> str:
    """The command line of this process with `hydra.run.dir=<run_dir> trainer.resume=auto` (replacing any
    earlier values of those keys): rerun as is, it continues the stopped run in its own directory."""
    args = [a for a in _argv() if not a.lstrip("+").startswith(("hydra.run.dir=", "trainer.resume="))]
    args += [f"hydra.run.dir={os.path.abspath(run_dir)}", "trainer.resume=auto"]
    return " ".join(shlex.quote(a) for a in args)


def last_checkpoint(ckpt_dir: str) -> str:
    """Where a stopped run continues from, in words: the newest intact checkpoint under `ckpt_dir`, or that there is
    none yet."""
    from rltrain.utils.checkpoint import find_latest_valid

    found = find_latest_valid(ckpt_dir, log=lambda msg: None)
    return f"the last good checkpoint is {found[1]} (step {found[0]})" if found else \
        f"there is no checkpoint under {ckpt_dir} yet (trainer.save_freq)"


def interrupted_line(step: int, ckpt_dir: str, run_dir: str) -> str:
    """The one line a run stopped by Ctrl-C ends with: the step, its last checkpoint, the command that continues it."""
    return f"rltrain: interrupted at step {step}; {last_checkpoint(ckpt_dir)}; resume with: {resume_command(run_dir)}"


def discard_unstarted(path: str, job: str = "main") -> bool:
    """Remove the run directory `path` of a run refused before its first step, when it holds only what starting
    wrote (Hydra's .hydra/ and `<job>.log`, the lock, config.json, a checkpoints/ holding at most its lock) and
    nothing in it is a link. Returns whether it was removed; anything else is left as it is."""
    keep_if_more = {".hydra", f"{job}.log", LOCK_FILE, "config.json", "checkpoints"}
    try:
        names = set(os.listdir(path))
        inside = {n: sorted(os.listdir(os.path.join(path, n))) for n in (".hydra", "checkpoints") if n in names}
    except OSError:
        return False
    files = [os.path.join(path, n) for n in names - set(inside)]
    files += [os.path.join(path, d, n) for d, sub in inside.items() for n in sub]
    if not names <= keep_if_more or set(inside.get("checkpoints", [])) - {LOCK_FILE} or any(
            os.path.islink(p) or not os.path.isfile(p) for p in files) or any(
            os.path.islink(os.path.join(path, d)) for d in inside):
        return False
    try:
        for p in files:
            os.remove(p)
        for d in inside:
            os.rmdir(os.path.join(path, d))
        os.rmdir(path)
    except OSError:
        return False
    return True


def mark_finished(run_dir: str) -> None:
    try:
        write_text(os.path.join(run_dir, FINISHED_FILE), json.dumps({"pid": os.getpid()}) + "\n")
    except OSError:
        pass


def _read_config(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return cfg if isinstance(cfg, dict) else None


def checkpoint_run_config(ckpt: str) -> dict | None:
    """The config.json of the run that wrote checkpoint `ckpt` (<run>/checkpoints/step_N), if it is there (None for
    a checkpoint outside that layout: trainer.ckpt_dir elsewhere)."""
    root = os.path.dirname(os.path.abspath(ckpt))
    if os.path.basename(root) != "checkpoints":
        return None
    return _read_config(os.path.dirname(root))


_SAME_MODEL_KEYS = ("path", "builtin", "tokenizer", "overrides")


def model_differences(saved: dict, cfg: dict) -> list[str]:
    """`model.<key>` settings (shapes) on which the run config `saved` and `cfg` differ, as `key=old -> new`."""
    a, b = saved.get("model") or {}, cfg.get("model") or {}
    return [f"model.{k}={a.get(k)!r} -> {b.get(k)!r}" for k in _SAME_MODEL_KEYS if a.get(k) != b.get(k)]


def find_previous_run(run_dir: str, cfg: dict, log=None) -> tuple[str, int, str] | None:
    """For trainer.resume=auto in a fresh run dir: (run dir, step, checkpoint path) of the newest sibling of
    `run_dir` (same parent: Hydra's outputs/<experiment>/) whose config.json names the same experiment and
    model and which has an intact checkpoint under <it>/checkpoints, short of its total_steps; None when
    there is none, or when a newer run of the experiment finished (FINISHED_FILE): then this is a new run.
    Runs that are still live (locked) or of another model are skipped, with a line saying so."""
    from rltrain.utils.checkpoint import find_latest_valid

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    parent = os.path.dirname(os.path.abspath(run_dir))
    me = os.path.realpath(run_dir)
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    candidates = []
    for name in names:
        d = os.path.join(parent, name)
        if os.path.realpath(d) == me or not os.path.isfile(os.path.join(d, "config.json")):
            continue
        try:
            candidates.append((os.path.getmtime(os.path.join(d, "config.json")), d))  # when it started
        except OSError:
            continue
    experiment = (cfg.get("trainer") or {}).get("experiment_name")
    for _, d in sorted(candidates, reverse=True):  # newest first
        saved = _read_config(d)
        if saved is None or (saved.get("trainer") or {}).get("experiment_name") != experiment:
            continue
        if os.path.exists(os.path.join(d, FINISHED_FILE)):
            return None  # the newest runs before this one finished: nothing to continue
        if (saved.get("trainer") or {}).get("ckpt_dir"):
            continue  # its checkpoints live elsewhere; not this directory's
        diff = model_differences(saved, cfg)
        if diff:
            log(f"rltrain: not resuming from {d}: another model ({', '.join(diff)})")
            continue
        if is_locked(d):
            log(f"rltrain: not resuming from {d}: a live run ({_holder(os.path.join(d, LOCK_FILE))}) is using it")
            continue
        found = find_latest_valid(os.path.join(d, "checkpoints"), log=log)
        total = (saved.get("trainer") or {}).get("total_steps")
        if found is not None and not (isinstance(total, int) and found[0] >= total):
            return d, found[0], found[1]
    return None
