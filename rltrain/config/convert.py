"""The one conversion from what a caller holds (a composed Hydra DictConfig, a plain dict such as config.json or a
tool's partial dict, or the typed object itself) to the typed schema objects of schema.py.

Entry points call `as_config` once; every component after that reads attributes of its own sub-config. Objects are
plain dataclasses (they pickle, so Ray sends them to workers). Unknown keys and wrong types raise here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from rltrain.config.schema import RLConfig

T = TypeVar("T")


def as_config(cfg: Any, cls: type[T] = RLConfig) -> T:  # type: ignore[assignment]
    """`cfg` as a `cls` object (RLConfig, SFTConfig or any section such as RolloutConfig); keys missing from a
    dict take the schema's defaults."""
    if isinstance(cfg, cls):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), cfg))  # type: ignore[return-value]


def as_dict(cfg: Any) -> dict:
    """A typed config (or DictConfig / dict) as a plain nested dict: config.json, the loggers' run config."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)
