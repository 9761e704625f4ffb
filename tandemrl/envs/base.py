"""The environment contract: score one completion of one prompt.

``score`` may raise: the rollout manager records that as a data failure of the prompt (with
the prompt id and the error) and applies the retry/drop budgets; it never crashes the
controller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tandemrl.records import EnvResult, PromptItem


class Environment(ABC):
    @abstractmethod
    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        """Reward (and keep flag, metadata) for ``completion`` of ``item``."""

    def item_metadata(self, item: PromptItem) -> dict[str, object]:
        """Metadata every environment attaches: the prompt's ``task_source`` when it has one."""
        if item.task_source is None:
            return {}
        return {"task_source": item.task_source}
