"""Configuration: typed models, YAML loading with interpolation and overrides, validation."""

from tandemrl.config.models import MasterConfig

__all__ = ["MasterConfig"]
