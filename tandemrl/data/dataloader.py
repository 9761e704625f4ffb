"""The prompt dataloader: dataset records → ``PromptItem`` in epochs, resumable exactly.

Order: epoch ``e`` visits every record once, in a permutation drawn from
``random.Random(seed + e)`` (identity when ``shuffle`` is off). The item at position ``i`` of
epoch ``e`` has ``prompt_id = f"e{e}-i{i}"``, so ids are stable across restarts. After
``max_num_epochs`` epochs the loader is exhausted.

Requeue: prompts handed back (for example by rollout recovery after a restart) come out
before any new prompt, first in first out, keeping their original ids.

State: ``state_dict()`` holds the epoch, the position in it, the seed, the shuffle flag, the
dataset fingerprint (sha256 over the records) and the requeued items, all plain Python
values (safe for ``torch.load(weights_only=True)`` and JSON). Loading it into a loader of the
same dataset and seed continues with exactly the prompts not yet handed out; a different
dataset, seed or shuffle flag is refused.
"""

from __future__ import annotations

import random
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from tandemrl.config.models import DataConfig
from tandemrl.data.dataset import PromptRecord, dataset_fingerprint, load_prompt_records
from tandemrl.records import PromptItem

_PROMPT_ID = re.compile(r"e(\d+)-i(\d+)")
STATE_KEYS = ("epoch", "position", "seed", "shuffle", "num_prompts", "fingerprint", "requeued")


class DataLoaderStateError(ValueError):
    """A saved dataloader state that does not fit this loader."""


def prompt_id_for(epoch: int, index: int) -> str:
    return f"e{epoch}-i{index}"


class PromptDataLoader:
    def __init__(
        self,
        records: Sequence[PromptRecord],
        *,
        max_num_epochs: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not records:
            raise ValueError("the dataset holds no prompts (data.dataset)")
        if max_num_epochs < 1:
            raise ValueError(
                f"max_num_epochs must be a positive number of epochs, got {max_num_epochs}; "
                "bound the run with max_num_steps instead"
            )
        self._records = list(records)
        self.max_num_epochs = max_num_epochs
        self.seed = seed
        self.shuffle = shuffle
        self.fingerprint = dataset_fingerprint(self._records)
        self._epoch = 0
        self._position = 0
        self._requeued: deque[PromptItem] = deque()
        self._order_cache: tuple[int, list[int]] | None = None

    @classmethod
    def from_config(
        cls,
        cfg: DataConfig,
        *,
        max_num_epochs: int,
        gym_rows: bool = False,
        images: bool = False,
    ) -> PromptDataLoader:
        """The loader of ``data:``; ``images`` (``policy.is_vlm``): rows must hold images."""
        return cls(
            load_prompt_records(cfg, gym_rows=gym_rows, images=images),
            max_num_epochs=max_num_epochs,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
        )

    # -- position -------------------------------------------------------------------------

    @property
    def num_prompts(self) -> int:
        """Prompts in one epoch."""
        return len(self._records)

    @property
    def epoch(self) -> int:
        """The epoch the next new prompt comes from (``max_num_epochs`` once all are out)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Index in the current epoch of the next new prompt."""
        return self._position

    @property
    def num_requeued(self) -> int:
        return len(self._requeued)

    @property
    def remaining_in_epoch(self) -> int:
        """New prompts of the current epoch not handed out yet (requeued ones not counted)."""
        if self._epoch >= self.max_num_epochs:
            return 0
        return self.num_prompts - self._position

    @property
    def exhausted(self) -> bool:
        return not self._requeued and self._epoch >= self.max_num_epochs

    # -- drawing --------------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = list(range(self.num_prompts))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _item_at(self, epoch: int, index: int) -> PromptItem:
        dataset_index = self._epoch_order(epoch)[index]
        record = self._records[dataset_index]
        return PromptItem(  # positional, in field order (keywords cost more per prompt)
            prompt_id_for(epoch, index),  # prompt_id
            epoch,
            index,
            record.prompt,
            record.answer,
            record.task_source,
            record.agent_ref,
            {**record.metadata, "dataset_index": dataset_index},  # metadata
        )

    def item_for(self, prompt_id: str) -> PromptItem:
        """The prompt that was (or will be) drawn as ``prompt_id`` (``e{epoch}-i{index}``),
        rebuilt from its record; the cursor does not move. ValueError for another id."""
        match = _PROMPT_ID.fullmatch(prompt_id)
        if match is None or int(match.group(2)) >= self.num_prompts:
            raise ValueError(
                f"prompt id {prompt_id!r} is not one of this dataloader's "
                f"(e<epoch>-i<index>, index below {self.num_prompts})"
            )
        return self._item_at(int(match.group(1)), int(match.group(2)))

    def peek(self) -> PromptItem | None:
        """The prompt ``next_item`` would return, without consuming it."""
        if self._requeued:
            return self._requeued[0]
        if self._epoch >= self.max_num_epochs:
            return None
        return self._item_at(self._epoch, self._position)

    def next_item(self) -> PromptItem | None:
        """The next prompt (requeued ones first), or None when the loader is exhausted."""
        if self._requeued:
            return self._requeued.popleft()
        if self._epoch >= self.max_num_epochs:
            return None
        item = self._item_at(self._epoch, self._position)
        self._position += 1
        if self._position == self.num_prompts:
            self._epoch += 1
            self._position = 0
        return item

    def take(self, count: int) -> list[PromptItem]:
        """Up to ``count`` prompts (fewer only when the loader runs out)."""
        if count < 0:
            raise ValueError(f"take() needs a count >= 0, got {count}")
        items = []
        while len(items) < count:
            item = self.next_item()
            if item is None:
                break
            items.append(item)
        return items

    def __iter__(self) -> Iterator[PromptItem]:
        return self

    def __next__(self) -> PromptItem:
        item = self.next_item()
        if item is None:
            raise StopIteration
        return item

    def requeue(self, items: Iterable[PromptItem]) -> None:
        """Hand prompts back; they come out before new ones, in the order given."""
        queued_ids = {item.prompt_id for item in self._requeued}
        for item in items:
            if item.prompt_id in queued_ids:
                raise ValueError(
                    f"prompt {item.prompt_id} is already requeued; requeueing it twice "
                    "would generate it twice"
                )
            queued_ids.add(item.prompt_id)
            self._requeued.append(item)

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": self.num_prompts,
            "fingerprint": self.fingerprint,
            "requeued": [asdict(item) for item in self._requeued],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise DataLoaderStateError(f"dataloader state lacks {missing}; it is not a saved state")
        if state["fingerprint"] != self.fingerprint:
            raise DataLoaderStateError(
                f"dataloader state was saved for a different dataset (fingerprint "
                f"{str(state['fingerprint'])[:12]}…, {state['num_prompts']} prompts) than "
                f"data.dataset gives now ({self.fingerprint[:12]}…, {self.num_prompts} prompts); "
                "resume with the dataset and data.seed of the saved run, or start a new run"
            )
        if state["seed"] != self.seed:
            raise DataLoaderStateError(
                f"dataloader state was saved with data.seed={state['seed']}, but data.seed is "
                f"{self.seed}; the epoch order depends on it, so resume with the saved seed"
            )
        if state["shuffle"] != self.shuffle:
            raise DataLoaderStateError(
                f"dataloader state was saved with data.shuffle={state['shuffle']}, but "
                f"data.shuffle is {self.shuffle}; resume with the saved value"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_prompts:
            raise DataLoaderStateError(
                f"dataloader state has epoch={epoch}, position={position}; expected epoch >= 0 "
                f"and 0 <= position < {self.num_prompts}"
            )
        requeued = [PromptItem(**fields) for fields in state["requeued"]]
        self._epoch, self._position = epoch, position
        self._requeued = deque()
        self.requeue(requeued)
