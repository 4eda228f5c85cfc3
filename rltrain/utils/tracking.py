"""Metrics plumbing: one `Tracker` fans each step's metrics out to console, metrics.jsonl and wandb.

wandb runs offline when no WANDB_API_KEY is set (nothing needs a network); this module never computes metrics.
A run continued in its own directory (a Tracker started after step N > 0) keeps one record: metrics.jsonl keeps the
rows of steps <= N and the steps run again replace the later ones, and the wandb run whose id the directory holds
(WANDB_ID_FILE) continues. A fresh start (N = 0) in a used directory starts both anew.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any, Iterable, Mapping

from rltrain.utils.safefs import check_not_link, make_dirs, open_nofollow, write_text

LOGGERS = ("console", "jsonl", "wandb")
WANDB_ID_FILE = "wandb_run_id"  # in the run directory: the id of its wandb run, continued by a resume there

# Keys shown on the compact console line, in this order, when present.
CONSOLE_KEYS = (
    "critic/score/mean",
    "val/accuracy",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/ppo_kl",
    "response_length/mean",
    "perf/throughput",
    "sft/loss",
    "sft/val_loss",
    "timing_s/step",
)


SHORT_NAMES = {
    "critic/score/mean": "reward", "val/accuracy": "val_acc", "actor/pg_loss": "pg_loss",
    "actor/entropy": "entropy", "actor/grad_norm": "grad_norm", "actor/ppo_kl": "ppo_kl",
    "response_length/mean": "resp_len", "perf/throughput": "tok/s", "timing_s/step": "step_s",
    "sft/loss": "loss", "sft/val_loss": "val_loss",
}


def _to_float(v: Any) -> Any:
    if hasattr(v, "item"):
        try:
            return v.item()
        except (ValueError, RuntimeError):
            return v
    return v


def _jsonable(v: Any) -> Any:
    v = _to_float(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # json has no NaN/inf; keep them visible
    return v


class ConsoleLogger:
    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        parts = [f"step {step}"]
        for k in CONSOLE_KEYS:
            if k in metrics:
                v = _to_float(metrics[k])
                label = SHORT_NAMES.get(k, k)
                parts.append(f"{label}={v:.4g}" if isinstance(v, (int, float)) else f"{label}={v}")
        for k, v in metrics.items():
            if k.startswith("val/") and k != "val/accuracy" and k.endswith("accuracy"):
                parts.append(f"{k}={_to_float(v):.3f}")
        from tqdm import tqdm

        line = " | ".join(parts)
        with tqdm.external_write_mode(file=self.stream):  # keep an active progress bar intact
            print(line, file=self.stream, flush=True)
        to_log_files(line)

    def finish(self) -> None:
        pass


def to_log_files(line: str) -> None:
    """`line` into the log files of the root logger's file handlers only (the run directory's main.log, which Hydra
    opens), so the run's record holds what the console showed without printing it twice."""
    record = logging.LogRecord("rltrain", logging.INFO, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def progress_bar(total: int, start: int, desc: str):
    """A tqdm bar of steps on stderr, drawn only when stderr is a terminal (a piped log gets the step lines)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True,
                disable=None)


class JsonlLogger:
    """Rows of <run_dir>/metrics.jsonl; started after step `start_step` > 0 (a resume), the rows of later steps
    (and a line cut by a kill) are dropped first, so the steps run again replace them; at 0 the file starts empty."""

    def __init__(self, run_dir: str, start_step: int = 0):
        make_dirs(run_dir)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.lexists(self.path):
            _keep_rows_through(self.path, start_step)
        self._f = open_nofollow(self.path, "a")  # a link planted in its place is refused, not appended to

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def finish(self) -> None:
        self._f.close()


def _keep_rows_through(path: str, step: int) -> None:
    """Rewrite the metrics file `path` (atomically: a temp file renamed over it) with only its whole rows of steps
    <= `step` (none when `step` is 0)."""
    with open_nofollow(path) as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines if step > 0 else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the last line of a killed run, cut short
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    if len(kept) == len(lines):
        return
    tmp = path + ".tmp"
    with open_nofollow(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class WandbLogger:
    """A wandb run under <run_dir>/wandb. Its id is kept in <run_dir>/WANDB_ID_FILE: started after step
    `start_step` > 0 in a directory that holds one, the same wandb run continues (`resume="allow"`), and steps wandb
    already has (run again after the checkpoint, with the same values) are not sent twice."""

    def __init__(self, run_dir: str, project: str, name: str, config: dict | None, start_step: int = 0):
        try:
            import wandb
        except ImportError as err:  # a core dependency; only missing in broken installs
            raise ImportError("trainer.logger includes 'wandb' but wandb is not installed: "
                              "pip install wandb, or drop 'wandb' from trainer.logger") from err
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        make_dirs(run_dir)
        check_not_link(os.path.join(run_dir, "wandb"))  # wandb writes under <run_dir>/wandb: never through a link
        id_file = os.path.join(run_dir, WANDB_ID_FILE)
        run_id = _read_id(id_file) if start_step > 0 else None
        self.run = wandb.init(project=project, name=name, config=config, dir=run_dir, mode=mode, id=run_id,
                              resume="allow" if run_id else None, reinit="finish_previous")
        self._next_step = 0
        if run_id is None:
            write_text(id_file, f"{self.run.id}\n")
        else:
            try:  # online: the step after the last one the server holds (offline runs know none: 0)
                self._next_step = int(self.run.step)
            except Exception:  # noqa: BLE001 (a disabled or shared run has no step counter: send every step)
                pass

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if step < self._next_step:
            return  # wandb holds this step from before the resume (the same numbers) and would refuse it again
        self.run.log({k: _to_float(v) for k, v in metrics.items()}, step=step)

    def finish(self) -> None:
        self.run.finish()


def _read_id(path: str) -> str | None:
    try:
        with open_nofollow(path) as f:
            run_id = f.read().strip()
    except OSError:
        return None
    return run_id if run_id and run_id.replace("-", "").replace("_", "").isalnum() else None


class Tracker:
    """Fan metrics out to the configured loggers.

    loggers: any of "console", "jsonl", "wandb"; run_dir holds metrics.jsonl and the wandb run. start_step: the
    step the run continues after (0: a fresh start; see the module docstring).
    """

    def __init__(self, loggers: Iterable[str], run_dir: str, *, project: str = "rltrain",
                 experiment: str = "run", config: dict | None = None, console_stream=None, start_step: int = 0):
        loggers = list(loggers)
        unknown = [lg for lg in loggers if lg not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; allowed: {', '.join(LOGGERS)}")
        self.run_dir = run_dir
        self._loggers: dict[str, Any] = {}
        for lg in loggers:
            if lg == "console":
                self._loggers[lg] = ConsoleLogger(console_stream)
            elif lg == "jsonl":
                self._loggers[lg] = JsonlLogger(run_dir, start_step)
            elif lg == "wandb":
                self._loggers[lg] = WandbLogger(run_dir, project, experiment, config, start_step)

    @property
    def wandb_run(self):
        lg = self._loggers.get("wandb")
        return lg.run if lg is not None else None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for lg in self._loggers.values():
            lg.log(metrics, step)

    def finish(self) -> None:
        for lg in self._loggers.values():
            lg.finish()
        self._loggers = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()


def read_metrics(run_dir: str) -> list[dict]:
    """Rows of <run_dir>/metrics.jsonl, one per step (rows of one step merged, the later values winning)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]
