"""One pass over a config file: every problem of every stage, cross-field rules included.

``check_config(path, overrides)`` loads the file (``loader.read_config``) and, whenever a
config could be built from what passed, runs the cross-field rules on it in the same pass,
so the first run shows every blocker: unknown keys, refused NeMo-RL subtrees, type errors
and cross-field problems together. Values that loading had to leave out (unresolvable,
refused, of the wrong type) are replaced by their defaults for that check; a cross-field
message that names one of them is not shown, since it would judge the default rather than
the user's value. ``load_and_validate`` is the strict form ``train`` and ``validate`` use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import LoadReport, read_config
from tandemrl.config.models import MasterConfig
from tandemrl.config.validate import validate_single_controller_config


@dataclass
class ConfigReport:
    """Everything one check of a config found."""

    config: MasterConfig | None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    load: LoadReport | None = None

    @property
    def valid(self) -> bool:
        return self.config is not None and not self.errors


def check_config(path: str | Path, overrides: Iterable[str] = ()) -> ConfigReport:
    """Load ``path`` and run every rule; file and override problems raise ConfigError."""
    load = read_config(path, overrides)
    return check_loaded(load)


def check_loaded(load: LoadReport) -> ConfigReport:
    report = ConfigReport(
        config=load.config, errors=list(load.problems), notices=list(load.notices), load=load
    )
    if load.config is None:
        return report
    try:
        report.warnings = validate_single_controller_config(load.config)
    except ConfigError as exc:
        report.errors.extend(
            message for message in exc.messages if not _names_any(message, load.broken_paths)
        )
    return report


def load_and_validate(
    path: str | Path, overrides: Iterable[str] = ()
) -> tuple[MasterConfig, list[str], list[str]]:
    """(config, warnings, notices); raises ConfigError listing every problem."""
    report = check_config(path, overrides)
    if not report.valid or report.config is None:
        raise ConfigError(report.errors)
    return report.config, report.warnings, report.notices


def _names_any(message: str, paths: list[str]) -> bool:
    return any(_mentions(message, path) for path in paths)


def _mentions(message: str, path: str) -> bool:
    start = message.find(path)
    while start != -1:
        end = start + len(path)
        before_ok = start == 0 or not (message[start - 1].isalnum() or message[start - 1] in "_.")
        after_ok = end == len(message) or not (message[end].isalnum() or message[end] == "_")
        if before_ok and after_ok:
            return True
        start = message.find(path, start + 1)
    return False
