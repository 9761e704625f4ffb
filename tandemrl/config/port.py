"""``tandemrl port FILE``: the TandemRL config a NeMo-RL config becomes, and what did not come over.

The file is loaded exactly as ``train`` would load it (``defaults:`` chain, overrides,
interpolation, NeMo-RL names), then written back as one self-contained TandemRL config:
only the keys that were carried over, resolved, without ``defaults:``. Next to it comes
the list of what was not carried over, in three groups:

- refused: subtrees that change training and that TandemRL cannot honour, with what to do;
- not carried over: keys dropped as harmless (switched off, or speed, memory, ports,
  logging of parts TandemRL does differently), each with the reason;
- renamed or changed: keys carried over under another name or shape.

followed by what ``tandemrl validate`` still has to say about the ported config (unknown
keys, wrong types, cross-field rules). Loading the printed YAML gives the same config as
loading the original file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tandemrl.config.check import check_loaded
from tandemrl.config.loader import escape_references, read_config


@dataclass
class PortReport:
    yaml_text: str
    refused: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    remaining: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def runs_as_is(self) -> bool:
        return not self.refused and not self.remaining

    def summary(self, source: str) -> str:
        lines = [f"# ported from {source}"]
        sections = (
            ("refused (not supported by TandemRL; the run needs a change)", self.refused),
            ("still invalid (tandemrl validate on the ported config)", self.remaining),
            ("renamed or changed", self.changed),
            ("not carried over (harmless)", self.dropped),
            ("warnings", self.warnings),
        )
        for title, entries in sections:
            if entries:
                lines.append(f"{title}:")
                lines.extend(f"  - {entry}" for entry in entries)
        if self.runs_as_is:
            lines.append("the ported config is valid")
        return "\n".join(lines)


def port_config(path: str | Path, overrides: Iterable[str] = ()) -> PortReport:
    load = read_config(path, overrides)
    report = check_loaded(load)
    carried: dict[str, Any] = {}
    if load.config is not None:
        dumped = load.config.model_dump(mode="json", by_alias=True, exclude_unset=True)
        carried = escape_references(dumped)
    refused = [p for p in load.problems if ": not supported by TandemRL: " in p]
    remaining = [p for p in report.errors if p not in refused]
    return PortReport(
        yaml_text=yaml.safe_dump(carried, sort_keys=False),
        refused=refused,
        dropped=[f"{d.path}: {d.reason}" for d in load.dropped if not d.refused],
        changed=list(load.notices),
        remaining=remaining,
        warnings=report.warnings,
    )
