"""Configuration: the typed schema (Hydra ConfigStore) and the value validation run before anything starts.

Nothing here builds models or touches Ray; it only describes and checks what the user asked for.
"""

from rltrain.config.convert import as_config
from rltrain.config.entry import config_main
from rltrain.config.schema import RLConfig, register_configs
from rltrain.config.validate import ConfigError, validate_config

__all__ = ["RLConfig", "register_configs", "ConfigError", "validate_config", "as_config", "config_main"]
