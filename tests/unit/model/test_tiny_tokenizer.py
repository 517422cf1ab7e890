"""The tiny offline tokenizer: id layout, special-token handling, round trips, HF loading."""

from __future__ import annotations

import functools
import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from m3serve.model.tiny.tokenizer import (
    NUM_SPECIAL_SLOTS,
    REAL_SPECIAL_BASE,
    SPECIAL_TOKENS,
    build_tokenizer,
    special_base,
    special_token_ids,
    write_tokenizer_files,
)

# The real MiniMax-M3 ids (model-m3.md F.1), written out independently of the module's table.
REAL_IDS = {
    "]!p~[": 200000,
    "]~b]": 200019,
    "[e~[": 200020,
    "]!d~[": 200021,
    "]<]image[>[": 200025,
    "]<]video[>[": 200026,
    "]<]start of image[>[": 200029,
    "]<]end of image[>[": 200030,
    "]<]start of video[>[": 200031,
    "]<]end of video[>[": 200032,
    "]<]vision pad[>[": 200033,
    "]~!b[": 200034,
    "<think>": 200050,
    "</think>": 200051,
    "<tool_call>": 200052,
    "</tool_call>": 200053,
    "]<]frame[>[": 200054,
    "]<]start of frame[>[": 200055,
    "]<]end of frame[>[": 200056,
    "<|content_altered_placeholder|>": 200057,
    "]<]minimax[>[": 200058,
    "<mm:think>": 200059,
    "</mm:think>": 200060,
}

SAMPLES = [
    "Hello, world!",
    "]~!b[]~b]user\nWhat's the weather in Beijing?[e~[\n]~b]ai\n<mm:think>",
    ']<]minimax[>[<invoke name="get_weather">]<]minimax[>[<location>Beijing'
    "]<]minimax[>[</location>",
    "café 日本語 😀 🇯🇵   \t\n\n  x = [1, 2, 3]",
    "",
]


@functools.cache
def tokenizer(vocab_size: int = 512) -> Tokenizer:
    return build_tokenizer(vocab_size)


def roundtrip(tok: Tokenizer, text: str) -> str:
    return tok.decode(tok.encode(text).ids, skip_special_tokens=False)


def test_build_is_deterministic() -> None:
    assert build_tokenizer(512).to_str() == build_tokenizer(512).to_str()


def test_special_table_matches_real_ids() -> None:
    assert len(SPECIAL_TOKENS) == NUM_SPECIAL_SLOTS
    assert sorted(SPECIAL_TOKENS.values()) == list(range(NUM_SPECIAL_SLOTS))
    for token, real_id in REAL_IDS.items():
        assert SPECIAL_TOKENS[token] == real_id - REAL_SPECIAL_BASE
    assert SPECIAL_TOKENS["]<]reserved_1[>["] == 1
    assert special_token_ids(200064) == {
        t: REAL_SPECIAL_BASE + o for t, o in SPECIAL_TOKENS.items()
    }


@pytest.mark.parametrize("vocab_size", [320, 512])
def test_layout(vocab_size: int) -> None:
    tok = tokenizer(vocab_size)
    assert tok.get_vocab_size() == vocab_size
    assert special_base(vocab_size) == vocab_size - 64
    for token, token_id in special_token_ids(vocab_size).items():
        assert tok.token_to_id(token) == token_id
        assert tok.id_to_token(token_id) == token
    assert tok.token_to_id("]<]minimax[>[") == vocab_size - 64 + 58
    base = tok.get_vocab(with_added_tokens=False)
    assert sorted(base.values()) == list(range(vocab_size - 64))
    merges = json.loads(tok.to_str())["model"]["merges"]
    assert len(merges) == vocab_size - 64 - 256


def test_large_vocab_uses_real_ids() -> None:
    tok = tokenizer(200064)
    assert tok.get_vocab_size() == 200064
    for token, real_id in REAL_IDS.items():
        assert tok.encode(f"x{token}y").ids[1] == real_id
    assert roundtrip(tok, SAMPLES[3]) == SAMPLES[3]


def test_too_small_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="320"):
        build_tokenizer(319)


@pytest.mark.parametrize("token", sorted(SPECIAL_TOKENS))
def test_special_tokens_are_single_ids_when_glued(token: str) -> None:
    tok = tokenizer()
    ids = tok.encode(f"abc{token}<invoke{token}{token}123").ids
    special_id = special_token_ids(512)[token]
    assert ids.count(special_id) == 3
    assert all(i < special_base(512) for i in ids if i != special_id)


def test_namespace_token_before_tag() -> None:
    tok = tokenizer()
    ids = tok.encode("]<]minimax[>[<invoke").ids
    assert ids[0] == special_token_ids(512)["]<]minimax[>["]
    assert tok.decode(ids[1:]) == "<invoke"


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_adds_no_bos_or_eos(text: str) -> None:
    ids = tokenizer().encode(text).ids
    specials = special_token_ids(512)
    assert ids.count(specials["]~!b["]) == text.count("]~!b[")
    assert ids.count(specials["[e~["]) == text.count("[e~[")
    assert roundtrip(tokenizer(), text) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(), st.sampled_from(sorted(SPECIAL_TOKENS)))))
def test_unicode_roundtrip(pieces: list[str]) -> None:
    text = "".join(pieces)
    assert roundtrip(tokenizer(), text) == text


def test_written_directory_loads_in_transformers(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tokenizer_files(tmp_path, 512)
    assert {p.name for p in tmp_path.iterdir()} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    specials = special_token_ids(512)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
        specials["]~!b["],
        specials["[e~["],
        specials["]!p~["],
    )
    for text in SAMPLES:
        assert hf(text)["input_ids"] == tokenizer().encode(text).ids
        assert hf.decode(tokenizer().encode(text).ids) == text
    prompt = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("]~!b[]~b]system\n") and prompt.endswith("]~b]user\nhi[e~[\n]~b]ai\n")
