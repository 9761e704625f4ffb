"""The counting task: continue counting from the prompt's last digit.

``583=`` asks for ``456``: the digits after the last digit of the prompt (before ``=``),
wrapping 9 → 0. The reward gives partial credit per position:

    reward = (positions where completion and target agree) / max(len(target), len(completion))

so a completion that is too long or too short is penalised by the longer length. The
completion is cut at the first end-of-sequence marker and stripped of whitespace first. The
tiny default model learns this in under a minute on one CPU thread (docs: FIELD-NOTES).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from tandemrl.envs.base import Environment
from tandemrl.records import EnvResult, PromptItem

# Markers a tokenizer may decode at the end of a completion; text after the first is ignored.
DEFAULT_EOS_STRINGS: tuple[str, ...] = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>")
DEFAULT_ANSWER_LENGTH = 3


def continue_count(last_digit: int, length: int = DEFAULT_ANSWER_LENGTH) -> str:
    """The ``length`` digits after ``last_digit``, wrapping 9 → 0: ``continue_count(3) == "456"``."""
    if not 0 <= last_digit <= 9:
        raise ValueError(f"last_digit must be 0..9, got {last_digit}")
    if length < 1:
        raise ValueError(f"answer length must be at least 1, got {length}")
    return "".join(str((last_digit + offset) % 10) for offset in range(1, length + 1))


def counting_target(prompt: str, length: int = DEFAULT_ANSWER_LENGTH) -> str:
    """The target for a counting prompt such as ``"583="``: continue from its last digit."""
    body = prompt.rstrip()
    body = body.removesuffix("=").rstrip()
    if not body or not body[-1].isdigit():
        raise ValueError(
            f"counting prompt {prompt!r} does not end in a digit followed by '=' (like '583=')"
        )
    return continue_count(int(body[-1]), length)


def clean_completion(completion: str, eos_strings: Sequence[str] = DEFAULT_EOS_STRINGS) -> str:
    """Cut at the first end-of-sequence marker, then strip surrounding whitespace."""
    cut = len(completion)
    for marker in eos_strings:
        position = completion.find(marker)
        if position != -1 and position < cut:
            cut = position
    return completion[:cut].strip()


def positional_match_reward(target: str, completion: str) -> float:
    """Per-position matches ÷ max(len(target), len(completion)); 0.0 when both are empty."""
    longest = max(len(target), len(completion))
    if longest == 0:
        return 0.0
    # map over two strings stops at the shorter one: the positions both have.
    return sum(map(operator.eq, target, completion)) / longest


class CountingEnv(Environment):
    """Scores counting completions with partial per-position credit.

    The target is the prompt's ``answer`` when the dataset provides one (the built-in
    counting dataset does), otherwise it is derived from the prompt. ``answer_length``
    (``env.kwargs.answer_length``) sets the derived length; when it is set and a prompt's
    answer disagrees with the derived target, scoring raises instead of silently ignoring it.
    """

    def __init__(
        self,
        answer_length: int | None = None,
        eos_strings: Sequence[str] = DEFAULT_EOS_STRINGS,
    ) -> None:
        if answer_length is not None and answer_length < 1:
            raise ValueError(f"env.kwargs.answer_length must be at least 1, got {answer_length}")
        self.answer_length = answer_length
        self.eos_strings = tuple(eos_strings)
        # A completion holding none of the markers' first characters holds no marker: it is
        # only stripped (one set test instead of a search per marker). None: an empty marker,
        # which matches everywhere, so every completion takes the full search.
        self._marker_starts = (
            frozenset(marker[0] for marker in self.eos_strings) if all(self.eos_strings) else None
        )

    def target_for(self, item: PromptItem) -> str:
        if self.answer_length is None:
            if item.answer is not None:
                return str(item.answer).strip()
            return counting_target(item.prompt, DEFAULT_ANSWER_LENGTH)
        target = counting_target(item.prompt, self.answer_length)
        if item.answer is not None and str(item.answer).strip() != target:
            raise ValueError(
                f"prompt {item.prompt_id}: dataset answer {item.answer!r} disagrees with "
                f"env.kwargs.answer_length={self.answer_length} (target {target!r}); drop "
                "env.kwargs.answer_length to score against the dataset's answers"
            )
        return target

    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        return self._score_completions(item, [completion], [truncated])[0]

    def score_group(
        self, item: PromptItem, completions: Sequence[str], *, truncated: Sequence[bool]
    ) -> list[EnvResult | Exception]:
        if type(self).score is not CountingEnv.score:
            # A subclass changed how one completion is scored: score each through it.
            return super().score_group(item, completions, truncated=truncated)
        # A prompt whose target is unusable raises here: every completion of it fails.
        return self._score_completions(item, completions, truncated)

    def _score_completions(
        self, item: PromptItem, completions: Sequence[str], truncated: Sequence[bool]
    ) -> list[EnvResult]:
        # The target and the prompt's metadata are worked out once for the whole group.
        target = self.target_for(item)
        item_metadata = self.item_metadata(item)
        eos_strings = self.eos_strings
        marker_starts = self._marker_starts
        results: list[EnvResult] = []
        for completion, was_truncated in zip(completions, truncated, strict=True):
            if marker_starts is not None and marker_starts.isdisjoint(completion):
                cleaned = completion.strip()
            else:
                cleaned = clean_completion(completion, eos_strings)
            metadata: dict[str, object] = {
                "target": target,
                "completion": cleaned,
                "exact_match": cleaned == target,
                "truncated": was_truncated,
                **item_metadata,
            }
            reward = positional_match_reward(target, cleaned)
            results.append(EnvResult(reward, True, metadata))  # reward, keep
        return results
