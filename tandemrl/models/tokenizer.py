"""The built-in character tokenizer of the tiny models: one token per character, no merges.

Built offline with the ``tokenizers`` library and wrapped as a transformers fast tokenizer, so
it saves with ``save_pretrained`` and loads back with ``AutoTokenizer.from_pretrained``.

Why it is a byte-level BPE with an empty merge list rather than a plain WordLevel model:
transformers 5 ignores the saved pipeline for ``model_type == "qwen2"`` folders and rebuilds a
``Qwen2Tokenizer`` (byte-level BPE, Qwen's split regex) from the saved vocabulary and merges.
Using exactly that pipeline here, with no merges, makes every loader (``AutoTokenizer`` on a
Qwen2 or Llama folder, ``PreTrainedTokenizerFast.from_pretrained``) produce the same ids, and a
BPE without merges is a pure character split. Vocabulary entries are therefore byte-level
symbols (space is ``"Ġ"`` in ``convert_ids_to_tokens``); ``decode`` gives back plain text.

Ids 0-3 are the special tokens (``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``), then one id per
character of ``CHAR_ALPHABET`` in order, then one id per extra special token (a chat preset's
turn markers such as ``<|im_start|>``: matched whole, before the character split). Nothing is added around the text: ``"58="`` is three
ids. A character outside the alphabet is dropped by the encoder (byte-level BPE without that
byte, as ``Qwen2Tokenizer`` does); ``<unk>`` exists so that every loader agrees on the
vocabulary size.
"""

from __future__ import annotations

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
)
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)

# Enough for the built-in tasks: counting ("583=") and word-free arithmetic ("5/6+1/2=",
# "-3.75"). Keep it small: the vocabulary is the tiny models' embedding table.
CHAR_ALPHABET = "0123456789=+-*/.,:() "
# The chat presets' alphabet: the role names and words of a chat template and of a system
# prompt, line breaks, and the markup chat models answer in ("**42**", "\\boxed{42}").
CHAT_ALPHABET = CHAR_ALPHABET + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n?!'\"{}\\$_#"


def byte_level_symbol(char: str) -> str:
    """The printable stand-in byte-level BPE uses for a one-byte character (GPT-2 mapping)."""
    code = ord(char)
    if code > 255:
        raise ValueError(
            f"character {char!r} is not a single byte; the tiny tokenizer is ASCII-only"
        )
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if code in printable:
        return char
    # Non-printable bytes map, in byte order, to 256, 257, ...
    return chr(256 + [byte for byte in range(256) if byte not in printable].index(code))


def build_char_tokenizer(
    alphabet: str = CHAR_ALPHABET,
    extra_special_tokens: tuple[str, ...] = (),
    *,
    vocab_size: int | None = None,
) -> PreTrainedTokenizerFast:
    """A fast tokenizer that maps every character of ``alphabet`` to its own id, and each of
    ``extra_special_tokens`` (after them) to one id of its own. ``vocab_size``: pad the
    vocabulary with placeholder tokens (``<f{id}>``, never produced by encoding) up to a
    model's embedding size, so that any id a model of that size samples decodes to text."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"tokenizer alphabet {alphabet!r} repeats a character")
    clashes = set(extra_special_tokens) & set(SPECIAL_TOKENS)
    if clashes or len(set(extra_special_tokens)) != len(extra_special_tokens):
        raise ValueError(f"extra special tokens {extra_special_tokens!r} repeat a token")
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[byte_level_symbol(char)] = len(vocab)
    if vocab_size is not None:
        if extra_special_tokens:
            raise ValueError("vocab_size pads after the alphabet: give no extra_special_tokens")
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size {vocab_size} is below the alphabet's {len(vocab)}")
        for index in range(len(vocab), vocab_size):
            vocab[f"<f{index}>"] = index
    # The same pipeline Qwen2Tokenizer builds, with an empty merge list.
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    if extra_special_tokens:
        backend.add_special_tokens(
            [AddedToken(token, special=True, normalized=False) for token in extra_special_tokens]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        # The default clean-up would delete the space in "1 ." and similar.
        clean_up_tokenization_spaces=False,
    )
