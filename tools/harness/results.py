"""The results tables: one JSON-lines file per area under tools/results/ (AREAS), one line per run, keyed by
(tool, shape, device, variant). A benchmark tool upserts its summary rows (a rerun replaces its row, other rows
stay); the docs' generators and the planner's calibration read them. Must not run a benchmark or know any tool's
metrics.

A row: {"tool", "shape", "device", "variant"} (the key: the tool's name, the model or kernel shape, the machine kind
as `h200x2` or `cpu`, the tool's name for what varied), "date", optionally "config" (the trainer overrides that
reproduce it), "metrics" {name: number} and "note". A tool run on a machine whose checkout does not come back
writes its rows with `--results $OUT/results`, and they are merged here with

    python tools/harness/results.py merge OUT/results/*.jsonl     # upsert each file's rows into tools/results/
    python tools/harness/results.py show update [--tool bench_update] [--match 4b-] [--metrics step_s,mfu]
                                                                   # the rows as a markdown table
"""

from __future__ import annotations

import json
import os
import sys

AREAS = ("kernel", "rollout", "update", "placements", "moe", "offpolicy", "planner")
KEY = ("tool", "shape", "device", "variant")
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def table_path(area: str, results_dir: str | None = None) -> str:
    if area not in AREAS:
        raise ValueError(f"unknown results area {area!r}; one of {', '.join(AREAS)}")
    return os.path.join(results_dir or DEFAULT_DIR, f"{area}.jsonl")


def key_of(row: dict) -> tuple[str, ...]:
    missing = [k for k in KEY if not row.get(k)]
    if missing:
        raise ValueError(f"a results row needs {', '.join(KEY)}; missing {', '.join(missing)}: {row}")
    return tuple(str(row[k]) for k in KEY)


def read_rows(path: str) -> list[dict]:
    """The rows of one table file ([] when it does not exist); a malformed line is named with its number."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not a JSON row ({err})") from err
    return rows


def read(area: str, results_dir: str | None = None) -> list[dict]:
    return read_rows(table_path(area, results_dir))


def write_rows(path: str, rows: list[dict]) -> None:
    """The rows sorted by key, one per line, atomically (a reader never sees half a table)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for row in sorted(rows, key=key_of):
            f.write(json.dumps(row, default=str) + "\n")
    os.replace(path + ".tmp", path)


def upsert_rows(path: str, new: list[dict]) -> int:
    """Put `new` into the table file at `path`: a row whose key is already there replaces it, the others are
    added. Returns how many replaced an older row."""
    by = {key_of(r): r for r in read_rows(path)}
    replaced = 0
    for row in new:
        k = key_of(row)
        replaced += k in by
        by[k] = row
    write_rows(path, list(by.values()))
    return replaced


def upsert(area: str, rows: list[dict], results_dir: str | None = None) -> int:
    """upsert_rows into the area's table (under results_dir, default tools/results/)."""
    return upsert_rows(table_path(area, results_dir), rows)


def row(tool: str, shape: str, device: str, variant: str, metrics: dict, *, date: str, config: list[str] | None = None,
        note: str = "") -> dict:
    """One row in the tables' layout (keys in this order; config and note only when given)."""
    out = {"tool": tool, "shape": shape, "device": device, "variant": variant, "date": date}
    if config is not None:
        out["config"] = list(config)
    out["metrics"] = metrics
    if note:
        out["note"] = note
    return out


def add_arguments(ap, what: str, tag: bool = False) -> None:
    """A benchmark tool's --results (where its rows are upserted) and, with tag, --tag (added to each row's variant)."""
    ap.add_argument("--results", default=DEFAULT_DIR,
                    help=f"upsert {what} into the table here (default: %(default)s; on a machine whose checkout does "
                         "not come back: $OUT/results, then `python tools/harness/results.py merge`)")
    if tag:
        ap.add_argument("--tag", default="", help="added to each row's variant: rows of another machine or day kept "
                        "beside this one's; a rerun with the same tag replaces its rows")


def device_kind(name: str, gpus: int = 1) -> str:
    """`h200x2` for two `NVIDIA H200` GPUs (or the name `2 x NVIDIA H200`), `h100` for one H100, `cpu` for a
    `CPU (...)` name."""
    count, sep, rest = name.partition(" x ")
    if sep and count.strip().isdigit():
        name, gpus = rest, int(count)
    if name.upper().startswith("CPU"):
        return "cpu"
    kind = next((k for k in ("H200", "H100", "A100", "B200") if k in name.upper()), name.split()[-1]).lower()
    return kind + (f"x{gpus}" if gpus > 1 else "")


def markdown(rows: list[dict], metrics: list[str] | None = None) -> str:
    """The rows as a markdown table: the key, the date and the metrics (default: every metric any row has)."""
    names = metrics or sorted({k for r in rows for k in r.get("metrics", {})})
    lines = ["| " + " | ".join(["tool", "shape", "device", "variant", "date", *names]) + " |",
             "|" + "---|" * (5 + len(names))]
    for r in sorted(rows, key=key_of):
        cells = [*key_of(r), r.get("date", "")] + [_cell(r.get("metrics", {}).get(m)) for m in names]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def show(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="tools/harness/results.py show")
    ap.add_argument("area", choices=AREAS)
    ap.add_argument("--tool")
    ap.add_argument("--match", default="", help="only rows whose variant contains this")
    ap.add_argument("--device", help="only rows of this machine kind (h200x2, cpu, ...)")
    ap.add_argument("--metrics", help="comma-separated metric names (default: all)")
    args = ap.parse_args(argv)
    rows = [r for r in read(args.area) if (not args.tool or r["tool"] == args.tool) and args.match in r["variant"]
            and (not args.device or r["device"] == args.device)]
    print(markdown(rows, args.metrics.split(",") if args.metrics else None))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["show"]:
        return show(argv[1:])
    if len(argv) < 2 or argv[0] != "merge":
        print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
        return 2
    for path in argv[1:]:
        area = os.path.basename(path).rsplit(".", 1)[0]
        try:
            new = read_rows(path)
            replaced = upsert(area, new)
        except (ValueError, OSError) as err:
            print(f"results merge: {path}: {err}", file=sys.stderr)
            return 2
        print(f"{path}: {len(new)} rows into {table_path(area)} ({replaced} replaced)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
