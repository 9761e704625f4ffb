"""Turns of an agent episode → training sequences, from the exact token ids the engine used.

The trainer must see exactly the tokens the engine conditioned on and sampled, never text
tokenized again. Each turn of an episode (``AgentTurn``) holds its prompt ids as the engine
got them and the ids it sampled with their logprobs. ``merge_turns`` joins them by prefix:

    turn k continues the current sequence when its prompt starts with that sequence
    (the previous turn's prompt + completion): the tokens in between (a tool result, the
    environment's reply, the template's turn markers) join with mask 0 and logprob 0, then
    turn k's sampled tokens with mask 1 and their logprobs.

A turn whose prompt does not start that way (a chat template that drops earlier reasoning,
tool-call JSON re-serialized with other whitespace, a tokenizer whose re-encoding drifts) is
a prefix mismatch; ``on_prefix_mismatch`` decides: ``split`` starts a new sequence at that
turn (its own prompt ids, then its sampled tokens), ``error`` raises ``PrefixMismatch``. The
sampled ids are never replaced by re-encoded ones either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tandemrl.records import AgentTurn

OnPrefixMismatch = Literal["split", "error"]


class PrefixMismatch(ValueError):
    """A turn's prompt does not extend the previous turn's tokens (on_prefix_mismatch: error)."""


@dataclass
class CapturedSequence:
    """One training sequence made of one or more consecutive turns."""

    input_ids: list[int] = field(default_factory=list)
    token_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)  # indices of the merged turns
    start_weight_version: int = 0
    end_weight_version: int = 0

    @property
    def num_sampled_tokens(self) -> int:
        return int(sum(self.token_mask))

    def append_turn(self, index: int, turn: AgentTurn, new_prompt_ids: Sequence[int]) -> None:
        """Add the prompt tokens this sequence lacks (mask 0), then the turn's sampled ones."""
        if not self.turns:
            self.start_weight_version = turn.start_weight_version
        self.input_ids += new_prompt_ids
        self.token_mask += [0.0] * len(new_prompt_ids)
        self.logprobs += [0.0] * len(new_prompt_ids)
        self.input_ids += turn.token_ids
        self.token_mask += [1.0] * len(turn.token_ids)
        self.logprobs += turn.logprobs
        self.turns.append(index)
        self.start_weight_version = min(self.start_weight_version, turn.start_weight_version)
        self.end_weight_version = max(self.end_weight_version, turn.end_weight_version)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return min(len(a), len(b))


def merge_turns(
    turns: Sequence[AgentTurn], *, on_prefix_mismatch: OnPrefixMismatch
) -> list[CapturedSequence]:
    """The training sequences of an episode's turns (see the module docstring)."""
    sequences: list[CapturedSequence] = []
    for index, turn in enumerate(turns):
        if len(turn.logprobs) != len(turn.token_ids):
            raise ValueError(
                f"turn {index} has {len(turn.token_ids)} sampled tokens but "
                f"{len(turn.logprobs)} logprobs"
            )
        if not turn.prompt_token_ids:
            raise ValueError(f"turn {index} has an empty prompt")
        current = sequences[-1] if sequences else None
        if current is not None:
            held = current.input_ids
            prompt = turn.prompt_token_ids
            if len(prompt) >= len(held) and prompt[: len(held)] == held:
                current.append_turn(index, turn, prompt[len(held) :])
                continue
            if on_prefix_mismatch == "error":
                at = first_difference(prompt, held)
                raise PrefixMismatch(
                    f"turn {index}'s prompt ({len(prompt)} tokens) does not start with turn "
                    f"{index - 1}'s prompt + completion ({len(held)} tokens): they differ at "
                    f"position {at} (token_capture.on_prefix_mismatch: error; set it to split "
                    "to train such turns as separate rows)"
                )
        sequence = CapturedSequence()
        sequence.append_turn(index, turn, turn.prompt_token_ids)
        sequences.append(sequence)
    return sequences
