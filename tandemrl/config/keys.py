"""Every key must be one the models define: report the others and return the tree without them.

An unknown key gets a suggestion only when it looks like a typo of a valid key (one token
misspelled, or underscores moved); two real words that merely look alike (``top_k`` and
``top_p``, ``backoff_base_s`` and ``backoff_max_s``) are not typos of each other, so the
message lists the valid keys instead. A sampler knob of another sampler mode gets its own
message, because it would otherwise do nothing; written as ``null`` it is simply dropped
(that is how a command line switches modes: ``async_rl.sampler.name=windowed
async_rl.sampler.max_lookahead_versions=null``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from tandemrl.config.schema import fields_by_key, mode_of, models_in


def check_keys(tree: dict[str, Any], model: type[BaseModel]) -> tuple[dict[str, Any], list[str]]:
    """(``tree`` without unknown keys, one problem per unknown key)."""
    problems: list[str] = []
    pruned = _check(tree, model, "", problems)
    return pruned, problems


def _check(data: Any, model: type[BaseModel], path: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        return data  # pydantic reports the wrong type
    fields = fields_by_key(model)
    allows_extra = model.model_config.get("extra") == "allow"
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = _join(path, str(key))
        info = fields.get(key) if isinstance(key, str) else None
        if info is None:
            if allows_extra:
                out[key] = value
            else:
                problems.append(unknown_key_message(dotted, str(key), sorted(fields)))
            continue
        candidates = models_in(info.annotation) if value is not None else []
        if len(candidates) == 1:
            out[key] = _check(value, candidates[0], dotted, problems)
        elif candidates:
            out[key] = _check_sampler(value, candidates, dotted, problems)
        else:
            out[key] = value
    return out


def _check_sampler(
    data: Any, modes: Sequence[type[BaseModel]], path: str, problems: list[str]
) -> Any:
    """Keys of a discriminated sampler block: tell apart typos and other modes' knobs."""
    if not isinstance(data, dict):
        return data
    by_mode = {mode_of(model): model for model in modes}
    chosen = by_mode.get(data.get("name"))
    if chosen is None:
        return data  # missing or unknown name: reported by pydantic
    if chosen.model_config.get("extra") == "allow":
        return data  # a custom sampler's extra keys are its constructor arguments
    chosen_keys = fields_by_key(chosen)
    chosen_mode = data["name"]
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if key in chosen_keys:
            kept[key] = value
            continue
        owners = [
            mode
            for mode, model in by_mode.items()
            if mode != chosen_mode and key in model.model_fields and key not in ("name", "target")
        ]
        dotted = _join(path, str(key))
        if owners and value is None:
            continue  # another mode's knob, explicitly cleared
        if owners:
            problems.append(
                f"{dotted}: belongs to sampler mode(s) {', '.join(owners)}; it has no effect "
                f"under {chosen_mode} — remove it (or set it to null) or change {path}.name"
            )
        else:
            problems.append(unknown_key_message(dotted, str(key), sorted(chosen_keys)))
    return _check(kept, chosen, path, problems)


def unknown_key_message(dotted: str, key: str, valid: list[str]) -> str:
    close = [candidate for candidate in valid if is_typo_of(key, candidate)]
    if close:
        best = min(close, key=lambda candidate: _distance(key, candidate))
        return f"{dotted}: unknown key; did you mean {best}?"
    return f"{dotted}: unknown key; valid keys here: {', '.join(valid)}"


def is_typo_of(key: str, candidate: str) -> bool:
    """Does ``key`` look like a misspelling of ``candidate`` (not another word)?"""
    if key == candidate:
        return False
    if key.replace("_", "").lower() == candidate.replace("_", "").lower():
        return True
    words, candidate_words = key.lower().split("_"), candidate.lower().split("_")
    if len(words) != len(candidate_words):
        return False
    differing = [(a, b) for a, b in zip(words, candidate_words, strict=True) if a != b]
    if len(differing) != 1:
        return False
    word, candidate_word = differing[0]
    # A short valid word is a word of its own (k/p, max/base, lr/wd), not a typo target.
    if len(candidate_word) < 4:
        return False
    return _distance(word, candidate_word) <= max(1, len(candidate_word) // 4)


def _distance(a: str, b: str) -> int:
    """Edit distance with adjacent transpositions (optimal string alignment)."""
    rows = [list(range(len(b) + 1))]
    for i, char_a in enumerate(a, start=1):
        row = [i]
        for j, char_b in enumerate(b, start=1):
            cost = 0 if char_a == char_b else 1
            best = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + cost)
            if i > 1 and j > 1 and char_a == b[j - 2] and a[i - 2] == char_b:
                best = min(best, rows[-2][j - 2] + 1)
            row.append(best)
        rows.append(row)
    return rows[-1][-1]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
