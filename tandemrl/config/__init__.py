"""Configuration: typed models, YAML loading with interpolation and overrides, validation."""

from tandemrl.config.loader import config_to_dict, load_config
from tandemrl.config.models import MasterConfig
from tandemrl.config.validate import ConfigError, validate_single_controller_config

__all__ = [
    "ConfigError",
    "MasterConfig",
    "config_to_dict",
    "load_config",
    "validate_single_controller_config",
]
