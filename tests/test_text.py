"""Streaming detokenization: the pieces of any block split add up to the full decode, and no piece ends
inside a multi-byte character."""

from __future__ import annotations

import random

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from mtplm.text import StreamDecoder

CORPUS = [
    "plain words and spaces",
    "日本語のテキスト",
    "emoji 🎉🚀 and accents: café, naïve",
    "code: x = [1, 2]",
]


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
            pieces.append(decoder.push(ids[at : at + size]))
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


def _naive_stream(pieces: list[str], stops: list[str]) -> str:
    """The reference: after each piece, search the whole text so far; at the first piece where any stop string
    appears, cut at the earliest start among those found."""
    text = ""
    for piece in pieces:
        text += piece
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cuts:
            return text[: min(cuts)]
    return text


def test_stop_matcher_agrees_with_a_naive_search_for_any_split():
    from mtplm.text import StopMatcher

    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice("aab c") for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        pieces, at = [], 0
        while at < len(text):
            size = rng.randint(1, 4)
            pieces.append(text[at : at + size])
            at += size
        matcher, held, out = StopMatcher(stops), "", ""
        for piece in pieces:
            whole = held + piece
            cut = matcher.feed(piece, len(held))
            if cut is not None:
                out += whole[:cut]
                break
            keep = min(matcher.hold, len(whole))
            out, held = out + whole[: len(whole) - keep], whole[len(whole) - keep :]
        else:
            out += held
        assert out == _naive_stream(pieces, stops), (text, stops, pieces)


def test_a_long_stop_string_is_matched_incrementally():
    """A 40,000-character stop string fed one character at a time: the held text grows with the partial
    match, drops to nothing when it breaks, and the match is found where it completes. (Each piece costs
    O(piece) amortized, not O(L^2) as the old `endswith` over every prefix did; benchmarks, not tests, time
    it.)"""
    from mtplm.text import StopMatcher

    stop = "ab" * 20_000
    matcher = StopMatcher([stop])
    for n, ch in enumerate("ab" * 5_000):
        assert matcher.feed(ch, matcher.hold) is None and matcher.hold == n + 1
    assert matcher.feed("x", matcher.hold) is None and matcher.hold == 0
    text = "zz" + stop
    assert [matcher.feed(ch, 0) for ch in text][-1] == 1 - len(stop)  # counted from the last piece's start
