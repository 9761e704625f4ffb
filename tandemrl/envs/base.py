"""The environment contract: score one completion of one prompt, or a prompt group at once.

``score`` may raise: the rollout manager records that as a data failure of the prompt (with
the prompt id and the error) and applies the retry/drop budgets; it never crashes the
controller.

``score_group`` scores every completion of one prompt group in one call (the rollout manager
calls it once per generation round of a group). It returns one entry per completion, in
order: the ``EnvResult``, or the exception scoring that completion raised, so a failure is
charged to the sibling that caused it. The default calls ``score`` once per completion; an
environment that can do better (one target per prompt, one pass over the group) overrides it
and returns exactly what ``score`` would per completion. An override that raises instead
fails every completion of the call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tandemrl.records import EnvResult, PromptItem


class Environment(ABC):
    @abstractmethod
    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        """Reward (and keep flag, metadata) for ``completion`` of ``item``."""

    def score_group(
        self, item: PromptItem, completions: Sequence[str], *, truncated: Sequence[bool]
    ) -> list[EnvResult | Exception]:
        """Per completion of ``item``'s group, in order: its result or its scoring exception."""
        outcomes: list[EnvResult | Exception] = []
        for completion, was_truncated in zip(completions, truncated, strict=True):
            try:
                outcomes.append(self.score(item, completion, truncated=was_truncated))
            except Exception as exc:  # reward code of any kind: a data failure of this sibling
                outcomes.append(exc)
        return outcomes

    def item_metadata(self, item: PromptItem) -> dict[str, object]:
        """Metadata every environment attaches: the prompt's ``task_source`` when it has one."""
        if item.task_source is None:
            return {}
        return {"task_source": item.task_source}
