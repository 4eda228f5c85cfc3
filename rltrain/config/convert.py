"""The one conversion from what a caller holds (a composed Hydra DictConfig, a plain dict such as config.json or a
tool's partial dict, or the typed object itself) to the typed schema objects of schema.py.

Entry points (rltrain.main, rltrain.sft, python -m rltrain.plan, the tools) call `as_config` once; every component after
that takes the typed sub-config it needs. Objects are plain dataclasses (they pickle, so Ray sends them to workers).
Unknown keys and wrong types raise here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from rltrain.config.schema import RLConfig

T = TypeVar("T")


def as_config(cfg: Any, cls: type[T] = RLConfig) -> T:  # type: ignore[assignment]
    """`cfg` as a `cls` object (RLConfig, SFTConfig or any section such as RolloutConfig); keys missing from a
    dict take the schema's defaults. A key the schema does not have raises ConfigError naming it (Hydra's
    `+actor.foo=1` adds one to a composed config that would otherwise be carried along and never read)."""
    if isinstance(cfg, cls):
        return cfg
    from omegaconf import OmegaConf

    unknown = unknown_keys(cfg, cls)
    if unknown:
        from rltrain.config.validate import ConfigError

        raise ConfigError("; ".join(unknown_key_message(k, cls) for k in unknown))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), cfg))  # type: ignore[return-value]


def unknown_keys(cfg: Any, cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of the mapping `cfg` that the dataclass `cls` (recursively) does not declare."""
    from collections.abc import Mapping

    from omegaconf import DictConfig

    if not isinstance(cfg, (Mapping, DictConfig)):
        return []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if key not in fields:
            out.append(name)
            continue
        sub = fields[key].type
        sub = _SCHEMA_TYPES.get(sub, sub) if isinstance(sub, str) else sub
        if dataclasses.is_dataclass(sub):
            out.extend(unknown_keys(cfg[key], sub, prefix=f"{name}."))
    return out


def unknown_key_message(key: str, cls: type = RLConfig) -> str:
    """The one line for a dotted `key` that the schema `cls` does not declare, with the nearest keys it does
    (`trainer.total_step` -> did you mean trainer.total_steps?)."""
    *path, name = key.split(".")
    node, known = cls, []
    for i, part in enumerate(path):  # the deepest section of `key` that exists
        sub = {f.name: f.type for f in dataclasses.fields(node)}.get(part)
        sub = _SCHEMA_TYPES.get(sub, sub) if isinstance(sub, str) else sub
        if not dataclasses.is_dataclass(sub):
            name = ".".join(path[i:] + [name])
            break
        node, known = sub, known + [part]
    from rltrain.utils.errors import nearest

    prefix = "".join(f"{p}." for p in known)
    names = [f.name for f in dataclasses.fields(node)]
    close = nearest(name, names)
    if not close and "." in name:  # a misspelled section: `trainr.total_steps`
        head, _, rest = name.partition(".")
        close = [f"{c}.{rest}" for c in nearest(head, names)]
    hint = f"did you mean {' or '.join(prefix + c for c in close)}?" if close else \
        "unknown key; check its spelling and section: docs/guide/keys.md lists every key"
    return f"{key}: not a configuration key ({hint})"


def _schema_types() -> dict[str, type]:
    from rltrain.config import schema

    return {n: c for n, c in vars(schema).items() if dataclasses.is_dataclass(c)}


_SCHEMA_TYPES = _schema_types()  # field types are strings (from __future__ import annotations in schema.py)


def saved_run_config(saved: dict) -> RLConfig:
    """A run's config.json (as rltrain.main wrote it) as the typed RLConfig: the run of a checkpoint a teacher reads."""
    return as_config(saved)


def as_dict(cfg: Any) -> dict:
    """A typed config (or DictConfig / dict) as a plain nested dict: config.json, the loggers' run config."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)
