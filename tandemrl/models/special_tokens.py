"""The token ids that end a completion, and the padding id, of a model folder and its tokenizer.

A chat model ends its turn with a token its tokenizer may not call EOS: Llama 3's tokenizer
says ``<|end_of_text|>`` while a turn ends with ``<|eot_id|>``; the SmolLM2 folder converted from
GGUF reports ``<|im_start|>`` while turns end with ``<|im_end|>``. Model folders list the real
ones in ``generation_config.json`` (``eos_token_id``: one id or a list), which is what
transformers' ``generate`` stops on. ``stop_token_ids`` gathers, in this order and without
repeats:

1. ``eos_token_id`` of ``generation_config.json`` (every id of a list);
2. ``eos_token_id`` of ``config.json``;
3. the tokenizer's ``eos_token_id``;
4. ``policy.generation.stop_token_ids``;
5. ``policy.generation.stop_strings``, each of which must be exactly one token of the tokenizer
   (a special token such as ``<|im_end|>``, or any string that encodes to one id); a longer
   string is refused with a message naming it — generation stops on token ids only.

``pad_token_id``: the tokenizer's padding id, else the generation config's, else the first stop
id, else 0. Padding only fills positions that every mask ignores, so any id inside the
vocabulary works; a tokenizer without a pad token (Llama 3, the converted SmolLM2) is normal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _ids(value: Any, where: str) -> list[int]:
    """``eos_token_id`` as a list: None, one id or a list of ids."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in values):
        raise ValueError(f"{where}: eos_token_id must be an integer or a list of integers")
    return list(values)


def model_eos_token_ids(model_path: str | os.PathLike[str]) -> list[int]:
    """EOS ids the model folder names: ``generation_config.json`` first, then ``config.json``."""
    folder = Path(model_path)
    found: list[int] = []
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        path = folder / name
        config = _read_json(path)
        # Multimodal folders keep the language model's ids in text_config.
        value = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
        found += _ids(value, str(path))
    return list(dict.fromkeys(found))


def stop_string_ids(tokenizer: Any, stop_strings: Iterable[str]) -> list[int]:
    """The one token id of each of ``stop_strings`` (policy.generation.stop_strings)."""
    ids = []
    vocab = tokenizer.get_vocab()
    for text in stop_strings:
        token_id = vocab.get(text)
        if token_id is None:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"policy.generation.stop_strings: {text!r} is {len(encoded)} tokens for this "
                    "tokenizer; generation stops on single tokens only — give a string that is "
                    "one token (a special token such as <|im_end|>), or its id in "
                    "policy.generation.stop_token_ids"
                )
            token_id = encoded[0]
        ids.append(int(token_id))
    return ids


def stop_token_ids(
    tokenizer: Any,
    model_path: str | os.PathLike[str] | None,
    *,
    extra_ids: Iterable[int] = (),
    stop_strings: Iterable[str] = (),
) -> tuple[int, ...]:
    """Every token id that ends a completion (see the module docstring for the order)."""
    found = model_eos_token_ids(model_path) if model_path is not None else []
    if tokenizer.eos_token_id is not None:
        found.append(int(tokenizer.eos_token_id))
    found += [int(token_id) for token_id in extra_ids]
    found += stop_string_ids(tokenizer, stop_strings)
    return tuple(dict.fromkeys(found))


def pad_token_id(tokenizer: Any, model_path: str | os.PathLike[str] | None = None) -> int:
    """A padding id for ``tokenizer`` (see the module docstring), never None."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if model_path is not None:
        generation = _read_json(Path(model_path) / GENERATION_CONFIG_FILE)
        if isinstance(generation.get("pad_token_id"), int):
            return int(generation["pad_token_id"])
    stops = stop_token_ids(tokenizer, model_path)
    return stops[0] if stops else 0
