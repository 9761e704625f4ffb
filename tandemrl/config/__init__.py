"""Configuration: typed models, YAML loading (inheritance, interpolation, overrides,
NeMo-RL names), one-pass checking, and the cross-field rules."""

from tandemrl.config.check import ConfigReport, check_config, load_and_validate
from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import config_to_dict, load_config, read_config
from tandemrl.config.models import MasterConfig
from tandemrl.config.validate import validate_single_controller_config

__all__ = [
    "ConfigError",
    "ConfigReport",
    "MasterConfig",
    "check_config",
    "config_to_dict",
    "load_and_validate",
    "load_config",
    "read_config",
    "validate_single_controller_config",
]
