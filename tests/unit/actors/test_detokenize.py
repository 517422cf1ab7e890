"""Incremental detokenization: deltas concatenate to the full decode in any chunking, never split
a character, stop strings cut the text where a full-text search would, and cost stays O(n)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from m3serve.actors.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer
from m3serve.model.tiny.tokenizer import build_tokenizer, special_token_ids

VOCAB_SIZE = 512
TOKENIZER = build_tokenizer(VOCAB_SIZE)
SPECIAL_IDS = special_token_ids(VOCAB_SIZE)
SPECIALS = ["<mm:think>", "</mm:think>", "[e~[", "]<]minimax[>[", "]<]start of image[>["]

# Characters that stress the decoder: multi-byte scripts, 4-byte emoji (with modifiers and flag
# pairs), combining marks and whitespace runs, on top of anything hypothesis draws.
TRICKY = list("日本語中文한국어é\u0301\u0308😀🚀👍🏽🇯🇵❤️ \t\n\r")
any_char = st.characters(codec="utf-8", exclude_characters=REPLACEMENT_CHAR)
pieces = st.one_of(
    st.text(st.one_of(any_char, st.sampled_from(TRICKY)), max_size=12),
    st.sampled_from(["   ", "\n\n", " \t ", *SPECIALS]),
)
mixed_text = st.lists(pieces, max_size=8).map("".join)


def decode(ids: list[int], skip: bool = True) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=skip)


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def byte_id(value: int) -> int:
    """The id of the single-byte token for ``value`` (GPT-2's byte-to-character table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    char = chr(value) if value in printable else chr(256 + extra.index(value))
    token_id = TOKENIZER.token_to_id(char)
    assert token_id is not None
    return token_id


def bytes_ids(data: bytes) -> list[int]:
    return [byte_id(b) for b in data]


def chunkings(ids: list[int], data: st.DataObject) -> list[list[int]]:
    """Split ``ids`` at random places, empty chunks included."""
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 2), label="cuts")
    bounds = [0, *sorted(cuts), len(ids)]
    return [ids[a:b] for a, b in itertools.pairwise(bounds)]


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = [detok.push(chunk) for chunk in chunks]
    return [*deltas, detok.finish()]


def check_round_trip(ids: list[int], skip: bool, data: st.DataObject) -> None:
    """Deltas concatenate to the full decode; after each push the emitted text is a prefix of
    it, and all of the decode so far unless that ends in U+FFFD (maybe an unfinished char)."""
    full = decode(ids, skip)
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip)
    seen: list[int] = []
    deltas = []
    for chunk in chunkings(ids, data):
        deltas.append(detok.push(chunk))
        seen += chunk
        so_far = decode(seen, skip)
        assert full.startswith(detok.text)
        if not so_far.endswith(REPLACEMENT_CHAR):
            assert detok.text == so_far
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == full
    assert detok.num_tokens == len(ids)
    assert detok.stopped is None


@settings(max_examples=150, deadline=None)
@given(text=mixed_text, skip=st.booleans(), data=st.data())
def test_text_round_trips_in_any_chunking(text: str, skip: bool, data: st.DataObject) -> None:
    ids = encode(text)
    assert REPLACEMENT_CHAR not in decode(ids, skip)
    check_round_trip(ids, skip, data)


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40), skip=st.booleans(), data=st.data()
)
def test_random_ids_round_trip(ids: list[int], skip: bool, data: st.DataObject) -> None:
    # Arbitrary ids are often invalid UTF-8: their U+FFFDs must come out where a full decode
    # puts them, no more and no fewer.
    check_round_trip(ids, skip, data)


def test_character_split_over_byte_tokens_waits_for_its_last_byte() -> None:
    for char in ["é", "日", "😀"]:
        ids = bytes_ids(char.encode())
        detok = IncrementalDetokenizer(TOKENIZER)
        assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + [char]


def test_multi_token_push_emits_its_finished_part_at_once() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    # "abc" is final even though the push ends on the first bytes of an emoji.
    assert detok.push(encode("abc") + bytes_ids("😀".encode()[:2])) == "abc"
    assert detok.push(bytes_ids("😀".encode()[2:])) == "😀"


def test_finish_turns_an_unfinished_character_into_a_replacement_char() -> None:
    ids = encode("ok ") + bytes_ids("日".encode()[:2])
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.push(ids) == "ok "
    assert detok.finish() == REPLACEMENT_CHAR == decode(ids)[-1]
    assert detok.text == decode(ids)


def test_invalid_bytes_are_released_once_something_follows() -> None:
    ids = [byte_id(0xFF), *encode("a")]
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.push(ids[:1]) == ""  # held: could have been the start of a character
    assert detok.push(ids[1:]) == REPLACEMENT_CHAR + "a"


@pytest.mark.parametrize(
    ("skip", "expected"),
    [(True, "hi there"), (False, "hi<mm:think> there[e~[")],
)
def test_special_tokens_are_skipped_or_kept(skip: bool, expected: str) -> None:
    ids = [*encode("hi"), SPECIAL_IDS["<mm:think>"], *encode(" there"), SPECIAL_IDS["[e~["]]
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip)
    assert "".join(stream(detok, [[i] for i in ids])) == expected
    assert detok.num_tokens == len(ids)


@settings(max_examples=100, deadline=None)
@given(text=mixed_text, skip=st.booleans(), data=st.data())
def test_prompt_context_gives_the_text_after_the_prompt(
    text: str, skip: bool, data: st.DataObject
) -> None:
    ids = encode(text)
    split = data.draw(st.integers(0, len(ids)), label="split")
    prompt, generated = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip)
    out = "".join(stream(detok, chunkings(generated, data)))
    assert out == decode(ids, skip)[len(decode(prompt, skip)) :]
    assert detok.num_tokens == len(generated)


def test_prompt_context_keeps_a_sentencepiece_leading_space() -> None:
    # A Metaspace decoder drops the first token's leading space: without the prompt as context
    # the first generated word would lose it.
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace()
    assert IncrementalDetokenizer(tokenizer).push([1]) == "world"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[0])
    assert [detok.push([1]), detok.push([2]), detok.push([1])] == [" world", "!", " world"]


def test_numpy_ids_are_accepted() -> None:
    ids = np.array(encode("numpy ids 😀"), dtype=np.int32)
    detok = IncrementalDetokenizer(TOKENIZER, prompt_ids=np.array(encode("x"), dtype=np.int32))
    assert detok.push(ids[:3]) + detok.push(ids[3:]) + detok.finish() == "numpy ids 😀"


# ---------------------------------------------------------------- stop strings


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Brute force: scan end positions; the first stop string to end (the longest of those
    ending there) cuts the text where it starts."""
    for end in range(len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text.endswith(stop, 0, end):
                return text[: end - len(stop)], stop
    return text, None


STOP_ALPHABET = "ab c日😀\n"
stop_strings = st.text(STOP_ALPHABET, min_size=1, max_size=4)


@st.composite
def text_with_stops(draw: st.DrawFn) -> tuple[str, list[str]]:
    """Text over a small alphabet (so near-misses are common) with a stop string planted."""
    stops = draw(st.lists(stop_strings, min_size=1, max_size=4))
    extra = st.one_of(st.text(STOP_ALPHABET, max_size=6), st.sampled_from(SPECIALS))
    parts = draw(st.lists(extra, max_size=6))
    if draw(st.booleans()):
        parts.insert(draw(st.integers(0, len(parts))), draw(st.sampled_from(stops)))
    return "".join(parts), stops


@settings(max_examples=200, deadline=None)
@given(case=text_with_stops(), skip=st.booleans(), data=st.data())
def test_stop_strings_cut_like_a_search_of_the_full_text(
    case: tuple[str, list[str]], skip: bool, data: st.DataObject
) -> None:
    text, stops = case
    ids = encode(text)
    expected, expected_stop = reference_stop(decode(ids, skip), stops)
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip, stop=stops)
    deltas = []
    for chunk in chunkings(ids, data):
        was_stopped = detok.stopped is not None
        deltas.append(detok.push(chunk))
        assert expected.startswith(detok.text)  # nothing past the stop, ever
        if was_stopped:
            assert deltas[-1] == ""
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == expected
    assert detok.stopped == expected_stop


@settings(max_examples=100, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=30),
    stops=st.lists(st.text("abe[~ \ufffd", min_size=1, max_size=3), min_size=1, max_size=3),
    skip=st.booleans(),
    data=st.data(),
)
def test_stop_strings_on_random_ids(
    ids: list[int], stops: list[str], skip: bool, data: st.DataObject
) -> None:
    expected, expected_stop = reference_stop(decode(ids, skip), stops)
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip, stop=stops)
    assert "".join(stream(detok, chunkings(ids, data))) == expected
    assert detok.stopped == expected_stop


def run_chars(text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    """Push ``text`` one character at a time; the deltas (finish last) and the detokenizer."""
    detok = IncrementalDetokenizer(TOKENIZER, stop=stop)
    return stream(detok, [encode(c) for c in text]), detok


@pytest.mark.parametrize(
    ("text", "stops", "output", "stopped"),
    [
        ("xab", ["ab", "b"], "x", "ab"),  # overlapping: the longer one starts earlier
        ("xb", ["ab", "b"], "x", "b"),
        ("zabc", ["abc", "ab"], "z", "ab"),  # a prefix of another stop completes first
        ("abcd", ["abcd", "bc"], "a", "bc"),  # "bc" completes first, "abcd" is never seen
        ("one two three", ["two", "three"], "one ", "two"),
        ("a🚀b", ["🚀"], "a", "🚀"),
        ("no match here", ["xyz"], "no match here", None),
    ],
)
def test_stop_examples(text: str, stops: list[str], output: str, stopped: str | None) -> None:
    deltas, detok = run_chars(text, stops)
    assert "".join(deltas) == detok.text == output
    assert detok.stopped == stopped


def test_a_near_miss_is_held_then_released() -> None:
    deltas, detok = run_chars("xabx", ["abc"])
    assert deltas == ["x", "", "", "abx", ""]
    assert detok.stopped is None


def test_a_near_miss_at_the_end_is_released_by_finish() -> None:
    deltas, _ = run_chars("xab", ["abc"])
    assert deltas == ["x", "", "", "ab"]


def test_stop_spanning_pushes_ends_the_stream() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, stop=["STOP"])
    deltas = [detok.push(encode(c)) for c in "say STOP now"]
    assert deltas == ["s", "a", "y", " ", "", "", "", ""] + [""] * 4
    assert detok.stopped == "STOP"
    assert detok.push(encode("more")) == detok.finish() == ""
    assert detok.text == "say "
    assert detok.num_tokens == sum(len(encode(c)) for c in "say STOP now") + len(encode("more"))


def test_stop_on_a_kept_special_token() -> None:
    ids = [*encode("done"), SPECIAL_IDS["[e~["], *encode("tail")]
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=False, stop=["[e~["])
    assert "".join(stream(detok, [ids])) == "done"
    assert detok.stopped == "[e~["


def test_a_bare_string_is_one_stop_string() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, stop="cb")
    assert "".join(stream(detok, [encode("abcb")])) == "ab"
    assert detok.stopped == "cb"


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(TOKENIZER, stop=["ok", ""])
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.push([]) == ""
    detok.finish()
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.push(encode("late"))


# ---------------------------------------------------------------- cost


class CountingDecoder:
    """Wraps a tokenizer and counts the ids and characters it decodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids = 0
        self.chars = 0
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self.calls += 1
        self.ids += len(ids)
        self.chars += len(text)
        return text


@pytest.mark.parametrize("stop", [[], ["never appears", "zz"]])
def test_decoding_one_token_at_a_time_costs_linear_work(stop: list[str]) -> None:
    sample = "Café 日本語 😀👍🏽 <mm:think>ok</mm:think> x = [1, 2, 3]\n\t  done. "
    ids: list[int] = []
    while len(ids) < 2000:
        ids += encode(sample)
    ids = ids[:2000]
    counter = CountingDecoder(TOKENIZER)
    detok = IncrementalDetokenizer(counter, prompt_ids=encode(sample), stop=stop)
    out = "".join(stream(detok, [[i] for i in ids]))
    assert out == decode(encode(sample) + ids)[len(decode(encode(sample))) :]
    # Each push decodes a window of a few ids, twice at most (context and window).
    assert counter.calls <= 2 * len(ids) + 2
    assert counter.ids <= 8 * len(ids)
    assert counter.chars <= 8 * len(out)
