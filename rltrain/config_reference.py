"""Write docs/guide/keys.md, every configuration key of the typed schema (rltrain/config/schema.py) with its type,
default, allowed values and one line of meaning; `--check` exits 1 when the file is stale.

  python -m rltrain.config_reference            # (re)write docs/guide/keys.md (print it where no docs/ is beside)
  python -m rltrain.config_reference --check    # exit 1 and say so when docs/guide/keys.md differs from the schema

The meaning of a key is its comment in schema.py: the comment on its line, else the comment lines right above it
(a key inherited from a shared group takes the group's). The allowed values are the ones the validators check
(rltrain/config/validate.py's `_choice`, recorded while they run) and the rollout room's names. A key without a
meaning fails the generator: add a comment to the schema, never to the generated file.

It sits beside the entry points, not in config/, because it names what the rollout room accepts too (config/ may
not import rollout/: tests/test_architecture.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import os
import sys
import tokenize
import typing

from rltrain.config import schema, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, in a checkout
OUT = os.path.join(ROOT, "docs", "guide", "keys.md")
SCHEMA_FILE = schema.__file__

HEAD = """# Configuration keys

Every key of the typed schema, generated from `rltrain/config/schema.py` by `python -m rltrain.config_reference`
(`tests/config/test_config_reference.py` fails when this file is stale; change the schema's comments, not this file).
Defaults are the schema's: a recipe in `configs/` sets its own (`python -m rltrain.main --config-name NAME --cfg job`
prints a recipe's values). Override any key on the command line: `actor.lr=1e-6 trainer.total_steps=50`.
A misspelled key stops the run with the nearest key (`trainer.total_step` -> `trainer.total_steps`); a value
outside the allowed ones stops it with the list. `null` is Python's None.
"""


class _Recorder(list):
    """An error list that also records what validate._choice was asked to allow, per key."""

    def __init__(self) -> None:
        super().__init__()
        self.allowed: dict[str, tuple] = {}


def _comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's comment in schema.py (its line's, else the lines right above)."""
    src = open(SCHEMA_FILE, encoding="utf-8").read()
    lines = src.splitlines()
    inline: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            inline[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.parse(src).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            line = item.end_lineno or item.lineno
            text = inline.get(line) if not lines[line - 1].lstrip().startswith("#") else None
            if not text:  # the block of comment lines right above it
                above, j = [], item.lineno - 1
                while j >= 1 and lines[j - 1].lstrip().startswith("#"):
                    above.insert(0, lines[j - 1].strip().lstrip("#").strip())
                    j -= 1
                text = " ".join(above)
            out[(node.name, item.target.id)] = text
    return out


def _declaring(cls: type, name: str) -> type:
    """The base-most class of `cls` that declares field `name` (a shared group's key keeps the group's meaning)."""
    for base in reversed(cls.__mro__):
        if name in getattr(base, "__annotations__", {}):
            return base
    return cls


def _type_name(cls: type, name: str) -> str:
    hint = typing.get_type_hints(cls)[name]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        return _plain(inner) + " or null"
    return _plain(hint)


def _plain(t) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (list, typing.List):
        return f"list[{_plain(args[0])}]" if args else "list"
    if origin in (dict, typing.Dict):
        return "dict"
    return getattr(t, "__name__", str(t)).replace("typing.", "")


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v) if v != "" else '""'


def _walk(cls: type, prefix: str = ""):
    """(dotted key, declaring class, field name, default) of every leaf key of the dataclass `cls`."""
    obj = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        if dataclasses.is_dataclass(sub):
            yield from _walk(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f.name, getattr(obj, f.name)


def _allowed(validators: dict, cfgs: list) -> dict[str, tuple]:
    """Per key, the names the validators allow, recorded while they check each config of `cfgs`."""
    rec = _Recorder()
    for cfg in cfgs:
        for check in validators.values():
            check(rec, cfg)
    out = {k.removesuffix("[]"): v for k, v in rec.allowed.items()}
    return out


def _rl_allowed() -> dict[str, tuple]:
    from rltrain.rollout import ENGINES, TOOL_PATTERNS

    cfg = schema.RLConfig()
    probe = schema.RLConfig()  # the keys validated only when another is set
    probe.model.builtin = "tiny"
    probe.rollout.multi_turn.enable = True
    out = _allowed(validate.RL_VALIDATORS, [cfg, probe])
    out["rollout.engine"] = tuple(ENGINES)
    out["rollout.multi_turn.tool_pattern"] = (*TOOL_PATTERNS, "a regex with one capture group")
    return out


def _sft_allowed() -> dict[str, tuple]:
    probe = schema.SFTConfig()
    probe.model.builtin = "tiny"
    return _allowed(validate.SFT_VALIDATORS, [schema.SFTConfig(), probe])


def _table(root: type, allowed: dict[str, tuple], comments: dict, missing: list[str],
           same_as: type | None = None) -> list[str]:
    """The keys of `root` as one table, section by section (each key's first part); a section whose class is
    `same_as`'s section of that name is referred to above the table instead of repeated."""
    rows: list[str] = []
    referred: list[str] = []
    shared = {f.name for f in dataclasses.fields(same_as)} if same_as else set()
    for key, cls, name, default in _walk(root):
        top = key.split(".")[0]
        if top in shared and typing.get_type_hints(root)[top] is typing.get_type_hints(same_as)[top]:
            if top not in referred:
                referred.append(top)
            continue
        meaning = comments.get((_declaring(cls, name).__name__, name), "")
        if not meaning:
            missing.append(f"{key} ({_declaring(cls, name).__name__}.{name})")
        choices = allowed.get(key)
        shown = ", ".join(f"`{c}`" if not c.startswith("a ") else c for c in map(str, choices)) if choices else ""
        cells = [f"`{key}`", _type_name(cls, name), f"`{_value(default)}`", shown, meaning.replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    out = [""] + [f"The `{top}.*` keys of RL runs, above." for top in referred] + ([""] if referred else [])
    return out + ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|", *rows]


def render() -> str:
    """The reference's text. ValueError names the keys without a meaning in schema.py."""
    comments = _comments()
    missing: list[str] = []
    rl = _table(schema.RLConfig, _rl_allowed(), comments, missing)
    sft = _table(schema.SFTConfig, _sft_allowed(), comments, missing, same_as=schema.RLConfig)
    if missing:
        raise ValueError("keys without a one-line meaning in rltrain/config/schema.py (add a comment on the key's "
                         "line or right above it): " + ", ".join(missing))
    parts = [HEAD, "## RL runs (`python -m rltrain.main`, `python -m rltrain.plan`)", *rl, "",
             "## Supervised fine-tuning (`python -m rltrain.sft`)", *sft, ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/guide/keys.md differs from the schema")
    args = ap.parse_args(argv)
    try:
        text = render()
    except ValueError as err:
        print(f"config_reference: {err}", file=sys.stderr)
        return 2
    if not args.check and not os.path.isdir(os.path.join(ROOT, "docs")):  # an installed package: no docs/ here
        print(text)
        return 0
    if args.check:
        old = open(OUT, encoding="utf-8").read() if os.path.exists(OUT) else ""
        if old != text:
            print(f"config_reference: {os.path.relpath(OUT, ROOT)} is stale; run python -m rltrain.config_reference",
                  file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(os.path.relpath(OUT, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
