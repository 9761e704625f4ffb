"""A verifiable math environment: extract the final answer, compare it numerically.

Extraction, most explicit marker first (the first rule that finds a number wins), so that a
chat model's free-form reply is read the way a person would read it:

1. the last ``\\boxed{...}`` (nested braces allowed: ``\\boxed{\\frac{4}{3}}``);
2. the text after the last answer marker: ``answer:``, ``answer is``, ``answer =`` (any case,
   ``The final answer is 42.``, ``**Answer:** 42``);
3. the last markdown-bold span holding a number (``so it is **67**.``);
4. the text after the last ``=``;
5. the last number anywhere in the completion.

For rules 1-4 the first number in the marked text is the answer. A number is an integer, a
decimal or a simple fraction (``-12``, ``3.75``, ``1,024``, ``3/4``); before searching, LaTeX
fractions (``\\frac{3}{4}``, ``\\dfrac``, ``\\tfrac``) read as ``3/4`` and a Unicode minus
sign as ``-``. The reward is 1.0 when ``|answer - target| <= abs_tol + rel_tol * |target|``
and 0.0 otherwise; a completion with no number is flagged ``malformed`` in the metadata
(reward 0.0). A target that is not a number is a dataset error and raises.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from tandemrl.envs.base import Environment
from tandemrl.records import EnvResult, PromptItem

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*[-+]?\d+(?:\.\d+)?)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_ANSWER_MARKER_RE = re.compile(r"\banswer\b\W{0,3}?\s*(?:is\b\s*:?|:|=)", re.IGNORECASE)
_BOLD_RE = re.compile(r"\*\*([^*]+)\*\*")
_LATEX_FRACTION_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-"})

DEFAULT_ABS_TOL = 1e-6
DEFAULT_REL_TOL = 1e-6


def parse_number(text: str) -> Fraction:
    """Parse an integer, decimal or simple fraction exactly (``"3/4"`` → ``Fraction(3, 4)``)."""
    cleaned = text.strip().replace(",", "").replace(" ", "")
    if "/" in cleaned:
        numerator, _, denominator = cleaned.partition("/")
        denominator_value = Fraction(denominator)
        if denominator_value == 0:
            raise ValueError(f"{text!r} divides by zero")
        return Fraction(numerator) / denominator_value
    return Fraction(cleaned)


def _first_number(text: str) -> str | None:
    match = _NUMBER_RE.search(text)
    return match.group(0) if match else None


def _boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}``, braces matched (nested ones included)."""
    contents = []
    for match in _BOXED_RE.finditer(text):
        depth, start = 1, match.end()
        for position in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                contents.append(text[start:position])
                break
    return contents


def _normalise(completion: str) -> str:
    text = completion.translate(_MINUS_SIGNS)
    return _LATEX_FRACTION_RE.sub(r"\1/\2", text)


def extract_answer(completion: str) -> tuple[str | None, str]:
    """The answer text and the rule that found it (``boxed``, ``answer``, ``bold``,
    ``equals``, ``last``).

    Returns ``(None, reason)`` when the completion holds no number where one was expected.
    """
    text = _normalise(completion)
    boxed = _boxed_contents(text)
    if boxed:
        number = _first_number(boxed[-1])
        return (number, "boxed") if number is not None else (None, "empty_boxed")
    markers = list(_ANSWER_MARKER_RE.finditer(text))
    if markers:
        number = _first_number(text[markers[-1].end() :])
        if number is not None:
            return number, "answer"
    for span in reversed(_BOLD_RE.findall(text)):
        number = _first_number(span)
        if number is not None:
            return number, "bold"
    if "=" in text:
        number = _first_number(text.rsplit("=", 1)[1])
        if number is not None:
            return number, "equals"
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return numbers[-1], "last"
    return None, "no_number"


def answers_match(
    answer: Fraction,
    target: Fraction,
    *,
    abs_tol: float = DEFAULT_ABS_TOL,
    rel_tol: float = DEFAULT_REL_TOL,
) -> bool:
    return abs(float(answer - target)) <= abs_tol + rel_tol * abs(float(target))


def _target_value(answer: Any, item: PromptItem) -> Fraction:
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"prompt {item.prompt_id}: math answer must be a number, got {answer!r}")
    if isinstance(answer, int | float):
        return Fraction(answer)
    try:
        return parse_number(str(answer))
    except (ValueError, ZeroDivisionError) as error:
        raise ValueError(
            f"prompt {item.prompt_id}: math answer {answer!r} is not a number "
            "(expected an integer, decimal or fraction like 3/4)"
        ) from error


class MathEnv(Environment):
    """Reward 1.0 for a numerically correct final answer, 0.0 otherwise."""

    def __init__(self, abs_tol: float = DEFAULT_ABS_TOL, rel_tol: float = DEFAULT_REL_TOL) -> None:
        if abs_tol < 0 or rel_tol < 0:
            raise ValueError(
                f"env.kwargs.abs_tol and env.kwargs.rel_tol must be >= 0, got {abs_tol}, {rel_tol}"
            )
        self.abs_tol = abs_tol
        self.rel_tol = rel_tol

    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        target = _target_value(item.answer, item)
        answer_text, rule = extract_answer(completion)
        metadata: dict[str, object] = {"extraction": rule, "truncated": truncated}
        metadata.update(self.item_metadata(item))
        if answer_text is None:
            metadata.update(malformed=True, correct=False)
            return EnvResult(reward=0.0, metadata=metadata)
        try:
            answer = parse_number(answer_text)
        except (ValueError, ZeroDivisionError):
            # A completion such as "1/0" is the model's malformed output, not a scoring error.
            metadata.update(
                malformed=True, extracted=answer_text, extraction="unparsable", correct=False
            )
            return EnvResult(reward=0.0, metadata=metadata)
        correct = answers_match(answer, target, abs_tol=self.abs_tol, rel_tol=self.rel_tol)
        metadata.update(malformed=False, extracted=answer_text, correct=correct)
        return EnvResult(reward=1.0 if correct else 0.0, metadata=metadata)
