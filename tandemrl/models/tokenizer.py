"""The built-in character tokenizer of the tiny models: one token per character, no merges.

Built offline with the ``tokenizers`` library (a WordLevel model over single characters, a
pre-tokenizer that isolates every character, a decoder that concatenates) and wrapped as a
transformers fast tokenizer, so it saves with ``save_pretrained`` and loads back with
``AutoTokenizer.from_pretrained`` like any hub tokenizer.

Ids 0-3 are the special tokens (``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``), then one id per
character of ``CHAR_ALPHABET`` in order. A character outside the alphabet encodes to ``<unk>``.
Nothing is added around the text: ``encode("58=")`` is exactly three ids.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)

# Enough for the built-in tasks: counting ("583=") and word-free arithmetic ("5/6+1/2=",
# "-3.75"). Keep it small: the vocabulary is the tiny models' embedding table.
CHAR_ALPHABET = "0123456789=+-*/.,:() "


def build_char_tokenizer(alphabet: str = CHAR_ALPHABET) -> PreTrainedTokenizerFast:
    """A fast tokenizer that maps every character of ``alphabet`` to its own id."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"tokenizer alphabet {alphabet!r} repeats a character")
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # "[\s\S]" is any character, newline included (Oniguruma has no inline DOTALL flag).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        # The default clean-up would delete the space in "1 ." and similar.
        clean_up_tokenization_spaces=False,
    )
