"""Streaming detokenization: the pieces of any block split add up to the full decode, and no piece ends
inside a multi-byte character."""

from __future__ import annotations

import random

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from mtplm.text import StreamDecoder

CORPUS = ["plain words and spaces", "日本語のテキスト", "emoji 🎉🚀 and accents: café, naïve", "code: x = [1, 2]"]


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with few merges: most non-ASCII characters take several tokens."""
    backend = ByteLevelBPETokenizer()
    backend.train_from_iterator(CORPUS * 5, vocab_size=300, min_frequency=2, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer)


def test_pieces_add_up_to_the_full_text_for_any_blocks(byte_tokenizer):
    rng = random.Random(0)
    for trial in range(40):
        text = "".join(rng.choice(CORPUS) + " " for _ in range(3))
        ids = byte_tokenizer(text)["input_ids"]
        if trial % 2:  # also arbitrary token soup, with characters that never complete
            ids = [rng.randrange(len(byte_tokenizer)) for _ in range(60)]
        decoder, pieces, at = StreamDecoder(byte_tokenizer), [], 0
        while at < len(ids):
            size = rng.randint(1, 5)
            pieces.append(decoder.push(ids[at: at + size]))
            at += size
        pieces.append(decoder.flush())
        assert "".join(pieces) == byte_tokenizer.decode(ids)
        if trial % 2 == 0:
            assert all("\ufffd" not in piece for piece in pieces)  # complete text: never a broken character


def test_a_split_character_waits_for_its_last_byte(byte_tokenizer):
    ids = byte_tokenizer("🎉")["input_ids"]
    assert len(ids) > 1  # the emoji spans several tokens
    decoder = StreamDecoder(byte_tokenizer)
    assert [decoder.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1:]) == "🎉"
