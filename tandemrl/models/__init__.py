"""Models: the built-in tiny presets, the character tokenizer, and loading by folder."""

from tandemrl.models.tiny import (
    TINY_PRESETS,
    TINY_SCHEME,
    ModelPathError,
    load_causal_lm,
    load_tokenizer,
    preset_tokenizer_signature,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    resolve_tokenizer_path,
    tokenizer_signature,
)
from tandemrl.models.tokenizer import CHAR_ALPHABET, build_char_tokenizer

__all__ = [
    "CHAR_ALPHABET",
    "TINY_PRESETS",
    "TINY_SCHEME",
    "ModelPathError",
    "build_char_tokenizer",
    "load_causal_lm",
    "load_tokenizer",
    "preset_tokenizer_signature",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_path",
    "resolve_tokenizer_path",
    "tokenizer_signature",
]
