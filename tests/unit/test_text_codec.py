"""The controller's text codec: the direct-backend fast path gives the wrapper's exact output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandemrl.codec import _backend_is_exact, text_codec
from tandemrl.models import load_tokenizer
from tandemrl.models.tiny import resolve_model_path
from tandemrl.models.tokenizer import CHAR_ALPHABET


@pytest.fixture(scope="module", params=["qwen2-counting", "llama-small"])
def tokenizer(request, tmp_path_factory):
    path = resolve_model_path(f"tiny://{request.param}", tmp_path_factory.mktemp("models"))
    return load_tokenizer(Path(path))


def wrapper_codec(tokenizer):
    return (
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


def sample_texts(rng: random.Random) -> list[str]:
    # The alphabet, characters outside it (dropped), special-token spellings, empty text.
    pool = CHAR_ALPHABET + "abcXYZ\u00e9\n\t<>"
    texts = ["", " ", "583=", "<eos>", "1<pad>2", "  7 ", "3/4+1/2="]
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    return texts


def sample_ids(rng: random.Random, vocab_size: int) -> list[list[int]]:
    ids = [[], [0], [1], [0, 1, 2, 3]]  # special tokens only: skipped
    ids += [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(300)]
    return ids


def test_the_tiny_tokenizers_take_the_backend_path_with_identical_results(tokenizer):
    assert _backend_is_exact(tokenizer)
    codec = text_codec(tokenizer)
    encode, decode = wrapper_codec(tokenizer)
    rng = random.Random(0)
    for text in sample_texts(rng):
        assert codec.encode(text) == encode(text), text
    for ids in sample_ids(rng, len(tokenizer)):
        assert codec.decode(ids) == decode(ids), ids
    assert codec.eos_token_id == tokenizer.eos_token_id
    assert codec.pad_token_id == tokenizer.pad_token_id


def test_a_wrapper_setting_the_backend_lacks_falls_back_to_the_wrapper(tokenizer, monkeypatch):
    # The space clean-up happens in the wrapper only: the backend alone would differ.
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True
    )
    assert not _backend_is_exact(tokenizer)
    codec = text_codec(tokenizer)
    ids = tokenizer.encode("1 . 2 ,3", add_special_tokens=False)
    assert codec.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True) == "1. 2,3"
    assert tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True) == "1 . 2 ,3"


def test_backend_truncation_falls_back_to_the_wrapper(tokenizer):
    backend = tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=2)
    try:
        assert not _backend_is_exact(tokenizer)
        assert text_codec(tokenizer).encode("12345") == tokenizer.encode(
            "12345", add_special_tokens=False
        )
    finally:
        backend.no_truncation()
    assert _backend_is_exact(tokenizer)
