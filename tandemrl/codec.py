"""How prompt text becomes token ids and completions become text again: ``TextCodec``.

The rollout manager encodes every prompt and decodes every completion through one
``TextCodec``; ``text_codec(tokenizer)`` makes it from a transformers tokenizer (the
controller's), ``tandemrl.generation.fake.fake_codec`` from the fake engine's alphabet. It
lives below ``rollout/`` and ``generation/`` so that both can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandemrl.records import PromptItem


@dataclass(frozen=True)
class TextCodec:
    """How the rollout turns prompts into token ids and completions back into text."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_token_id: int | None
    pad_token_id: int
    # The text the model is given for a prompt (data.prompt_format, e.g. the chat template
    # rendering); None: the prompt text itself.
    render_prompt: Callable[[PromptItem], str] | None = None
    # Every id that ends a completion besides eos_token_id: the model folder's EOS ids and the
    # configured stops (tandemrl.models.special_tokens). Each request stops on all of them.
    stop_token_ids: tuple[int, ...] = ()
    # A vision-language run: the prompt's token ids and its processed images, both from the
    # model's processor (tandemrl.data.vision_prompts); None for text.
    encode_with_images: Callable[[PromptItem], tuple[list[int], dict[str, Any]]] | None = None

    def encode_prompt(self, item: PromptItem) -> list[int]:
        """The prompt token ids of ``item``'s generations."""
        if self.encode_with_images is not None:
            return self.encode_with_images(item)[0]
        return self.encode(item.prompt if self.render_prompt is None else self.render_prompt(item))

    def encode_prompt_inputs(self, item: PromptItem) -> tuple[list[int], dict[str, Any] | None]:
        """(prompt token ids, processed images or None) of ``item``'s generations."""
        if self.encode_with_images is not None:
            return self.encode_with_images(item)
        return self.encode_prompt(item), None


def text_codec(
    tokenizer: Any,
    *,
    render_prompt: Callable[[PromptItem], str] | None = None,
    stop_token_ids: tuple[int, ...] = (),
    pad_token_id: int | None = None,
    encode_with_images: Callable[[PromptItem], tuple[list[int], dict[str, Any]]] | None = None,
) -> TextCodec:
    """Prompt text -> ids and completion ids -> text for the rollout manager.

    The controller encodes every prompt and decodes every completion (128 per step on the
    default job), so when the transformers wrapper would only forward to its ``tokenizers``
    backend, the codec calls the backend directly and skips the wrapper's per-call argument
    handling (about a tenth of the controller's CPU). ``_backend_is_exact`` lists when that
    gives the very same ids and strings; otherwise the wrapper is called.
    """
    if pad_token_id is None:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    extras = {
        "render_prompt": render_prompt,
        "stop_token_ids": tuple(stop_token_ids),
        "encode_with_images": encode_with_images,
    }
    if _backend_is_exact(tokenizer):
        backend = tokenizer.backend_tokenizer
        return TextCodec(
            encode=lambda text: backend.encode(text, add_special_tokens=False).ids,
            decode=lambda ids: backend.decode(ids, skip_special_tokens=True),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad_token_id,
            **extras,
        )
    return TextCodec(
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_token_id,
        **extras,
    )


def _backend_is_exact(tokenizer: Any) -> bool:
    """True when ``encode``/``decode`` of ``tokenizer`` are plain calls of its backend.

    transformers' fast tokenizer encodes one text as ``backend.encode_batch([text])`` after
    switching the backend's truncation and padding off and setting its special-token
    splitting, and decodes as ``backend.decode`` followed by an optional space clean-up. So
    the backend alone is exact when the class overrides none of those methods, the backend
    has no truncation or padding set, its special-token splitting already matches, and the
    clean-up is off.
    """
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend):
        return False
    inherited = (
        cls.encode is PreTrainedTokenizerBase.encode
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._encode_plus is TokenizersBackend._encode_plus
        and cls._decode is TokenizersBackend._decode
    )
    backend = tokenizer.backend_tokenizer
    return (
        inherited
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)
        and not tokenizer.clean_up_tokenization_spaces
    )
