"""The one exception every config stage raises: ``ConfigError``, one actionable line per problem.

It sits at the bottom of the config package so that every stage (files, overrides,
interpolation, keys, cross-field rules) can raise it without importing another stage.
"""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """An invalid config; ``messages`` holds one actionable line per problem."""

    def __init__(self, messages: Iterable[str] | str) -> None:
        self.messages: list[str] = [messages] if isinstance(messages, str) else list(messages)
        count = len(self.messages)
        header = f"invalid config ({count} problem{'s' if count != 1 else ''}):"
        super().__init__("\n".join([header, *(f"  - {m}" for m in self.messages)]))
