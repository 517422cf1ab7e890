"""The grammar engine's compile side: the tokenizer's vocabulary as xgrammar sees it, and
compiled grammars cached by their `Constraint`, compiled on a worker thread.

Special tokens are given to xgrammar as a NUL byte followed by their text, so that no text rule
matches one: a grammar places a special token only by its id (`Token(id)` in EBNF), and the
tool-call grammar's free text excludes NUL. JSON grammars are also narrowed to the tokens whose
bytes JSON can hold at all (no control character but tab and line breaks): xgrammar 0.2.9's
bounded strings (`maxLength`) forget to exclude control characters, NUL included. The stop
tokens (EOS) stay allowed: xgrammar allows them exactly when the grammar can end.
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xgrammar

from m3serve.runtime.messages import Constraint

JSON_WHITESPACE = frozenset(b"\t\n\r")


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: the matcher's grammar, and a packed bitmask row [ceil(V/32)]
    (int32) that every mask of it is narrowed to (None: the grammar alone decides)."""

    compiled: xgrammar.CompiledGrammar
    narrow: torch.Tensor | None = None


Compiled = concurrent.futures.Future[Grammar]

# Runs of whitespace between JSON tokens are capped, so that a model (random test weights, or a
# real model in a bad state) cannot spend its whole budget on layout; nested pretty-printing
# stays well inside it.
MAX_JSON_WHITESPACE = 32
MAX_CACHED = 256  # compiled grammars kept, least recently asked for evicted first
SPECIAL_PREFIX = b"\x00"


class GrammarUnavailable(ValueError):
    """A constrained request reached an engine that cannot compile grammars (HTTP 400)."""


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


def tokenizer_vocab(tokenizer_json: dict[str, Any]) -> list[bytes]:
    """Every token id's bytes, from a byte-level BPE tokenizer.json; special tokens behind
    `SPECIAL_PREFIX` (see the module docstring)."""
    decoder = tokenizer_json.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise GrammarUnavailable("structured output needs a byte-level BPE tokenizer")
    alphabet = _byte_level_alphabet()
    by_id: dict[int, bytes] = {
        index: bytes(alphabet[char] for char in token)
        for token, index in tokenizer_json["model"]["vocab"].items()
    }
    for added in tokenizer_json.get("added_tokens", []):
        text = added["content"].encode()
        by_id[added["id"]] = SPECIAL_PREFIX + text if added.get("special") else text
    # Ids no token has (holes) get a spelling nothing produces, like the specials.
    return [by_id.get(i, SPECIAL_PREFIX) for i in range(max(by_id) + 1)]


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary, each distinct constraint once.

    `vocab_size` is the logits' width (it may exceed the tokenizer's: padding ids are never
    allowed); `stop_ids` are the ids that end a finished grammar.
    """

    def __init__(self, vocab: list[bytes], vocab_size: int, stop_ids: list[int]) -> None:
        self.info = xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
        self._compiler = xgrammar.GrammarCompiler(self.info, max_threads=1)
        # One thread: compiles queue behind each other, never behind the engine loop.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="m3serve-grammar")
        self._cache: dict[Constraint, Compiled] = {}
        self._json_tokens = _packed_row(vocab_size, _not_json(vocab, set(stop_ids)))

    @classmethod
    def for_model(cls, model_dir: Path, vocab_size: int, stop_ids: list[int]) -> GrammarCompiler:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise GrammarUnavailable(f"no tokenizer.json in {model_dir}")
        vocab = tokenizer_vocab(json.loads(path.read_text(encoding="utf-8")))
        return cls(vocab, vocab_size, stop_ids)

    def compile(self, constraint: Constraint) -> Compiled:
        """The compiled grammar of `constraint`: cached, or compiling from now on."""
        future = self._cache.pop(constraint, None)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, constraint)
        self._cache[constraint] = future  # most recent last
        while len(self._cache) > MAX_CACHED:
            del self._cache[next(iter(self._cache))]
        return future

    def _compile(self, constraint: Constraint) -> Grammar:
        if constraint.kind == "ebnf":
            return Grammar(self._compiler.compile_grammar(constraint.text))
        if constraint.kind == "json_object":
            # Not strict: strict mode would allow no property the schema does not name.
            compiled = self._compiler.compile_json_schema(
                '{"type": "object"}', strict_mode=False, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        else:
            compiled = self._compiler.compile_json_schema(
                constraint.text, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        return Grammar(compiled, self._json_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _not_json(vocab: list[bytes], keep: set[int]) -> list[int]:
    """Ids of the tokens no JSON text contains (a control character other than tab and line
    breaks: every special token, given as NUL + text), except `keep`."""
    return [
        i
        for i, token in enumerate(vocab)
        if i not in keep and any(byte < 0x20 and byte not in JSON_WHITESPACE for byte in token)
    ]


def _packed_row(vocab_size: int, banned: list[int]) -> torch.Tensor:
    """A packed bitmask row allowing every id below `vocab_size` except `banned`."""
    allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
    allowed[banned] = False
    allowed[vocab_size:] = False
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = (allowed.view(-1, 32).long() * weights).sum(dim=1)
    # Reinterpret as int32: bit 31 set is a negative word.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
