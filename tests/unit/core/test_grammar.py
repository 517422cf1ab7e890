"""The grammar compiler and the per-slot matchers, on the tiny tokenizer's real vocabulary:
special tokens never come out of text rules, compiled grammars are shared, masks follow the
tokens a request took, and a finished grammar says so."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar

from m3serve.core.grammar import SPECIAL_PREFIX, GrammarCompiler, tokenizer_vocab
from m3serve.core.matchers import GrammarMatchers
from m3serve.kernels.sampling import apply_token_bitmask
from m3serve.model.tiny.tokenizer import EOS_TOKEN, build_tokenizer, special_token_ids
from m3serve.runtime.messages import SKIPPED_TOKEN, Constraint

TOKENIZER_VOCAB = 512
VOCAB = 520  # logits wider than the tokenizer: ids 512.. are padding
SPECIALS = special_token_ids(TOKENIZER_VOCAB)
EOS = SPECIALS[EOS_TOKEN]
SCHEMA = Constraint("json_schema", json.dumps({"type": "object", "properties": {"n": {}}}))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOKENIZER_VOCAB)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    vocab = tokenizer_vocab(json.loads(tokenizer.to_str()))
    return GrammarCompiler(vocab, VOCAB, [EOS])


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    logits = apply_token_bitmask(torch.zeros(bitmask.shape[0], VOCAB), bitmask)
    return set(torch.nonzero(logits[row] == 0).flatten().tolist())


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_vocab_spells_special_tokens_behind_a_nul(tokenizer) -> None:
    vocab = tokenizer_vocab(json.loads(tokenizer.to_str()))
    assert len(vocab) == TOKENIZER_VOCAB
    assert all(vocab[i].startswith(SPECIAL_PREFIX) for i in SPECIALS.values())
    text = "Hello, wörld"
    assert b"".join(vocab[i] for i in ids(tokenizer, text)) == text.encode()


def test_an_equal_constraint_compiles_once(compiler: GrammarCompiler) -> None:
    first = compiler.compile(SCHEMA)
    again = compiler.compile(Constraint(SCHEMA.kind, SCHEMA.text))
    other = compiler.compile(Constraint("json_object"))
    assert again is first
    assert other is not first
    assert isinstance(first.result(timeout=30).compiled, xgrammar.CompiledGrammar)


def test_a_failed_compile_is_retried_not_cached(compiler: GrammarCompiler) -> None:
    broken = Constraint("ebnf", "root ::= undefined_rule")
    failed = compiler.compile(broken)
    assert failed.exception(timeout=30) is not None
    assert compiler.compile(broken) is not failed


def test_json_masks_never_allow_special_or_padding_ids(compiler: GrammarCompiler) -> None:
    matchers = GrammarMatchers(VOCAB)
    matchers.start(3, compiler.compile(Constraint("json_object")).result(timeout=30))
    allowed = allowed_ids(matchers.fill([3]))
    assert allowed, "an open object must allow some token"
    assert not allowed & set(SPECIALS.values())
    assert not allowed & set(range(TOKENIZER_VOCAB, VOCAB))


def test_unconstrained_rows_allow_everything_and_no_grammar_means_no_mask(
    compiler: GrammarCompiler,
) -> None:
    matchers = GrammarMatchers(VOCAB)
    assert matchers.fill([0, 1]) is None
    matchers.start(1, compiler.compile(SCHEMA).result(timeout=30))
    bitmask = matchers.fill([0, 1])
    assert allowed_ids(bitmask, 0) == set(range(VOCAB))
    assert allowed_ids(bitmask, 1) < set(range(VOCAB))


def test_masks_follow_accepted_tokens_until_the_grammar_ends(
    compiler: GrammarCompiler, tokenizer
) -> None:
    grammar = Constraint("ebnf", 'root ::= "yes" | "no"')
    matchers = GrammarMatchers(VOCAB)
    matchers.start(0, compiler.compile(grammar).result(timeout=30))
    *start, last = ids(tokenizer, "yes")
    assert start[0] in allowed_ids(matchers.fill([0]))
    assert [matchers.accept([0], [token]) for token in start] == [[False]] * len(start)
    assert EOS not in allowed_ids(matchers.fill([0])), "an unfinished answer may not stop"
    assert matchers.accept([0], [last]) == [False]
    assert allowed_ids(matchers.fill([0])) == {EOS}, "a complete answer may only stop"
    assert matchers.accept([0], [EOS]) == [True]


def test_a_resumed_request_replays_its_output_into_the_grammar(
    compiler: GrammarCompiler, tokenizer
) -> None:
    grammar = compiler.compile(Constraint("ebnf", 'root ::= "yes" | "no"')).result(timeout=30)
    matchers = GrammarMatchers(VOCAB)
    matchers.start(2, grammar, ids(tokenizer, "yes"))
    assert allowed_ids(matchers.fill([2])) == {EOS}


def test_a_new_request_in_the_slot_drops_the_old_grammar(compiler: GrammarCompiler) -> None:
    matchers = GrammarMatchers(VOCAB)
    matchers.start(0, compiler.compile(SCHEMA).result(timeout=30))
    matchers.start(0, None)
    assert matchers.fill([0]) is None
    assert matchers.accept([0], [5]) == []


def test_a_dead_rows_draw_leaves_its_grammar_alone(
    compiler: GrammarCompiler, tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """A row whose request ended (on a stop token, its grammar unfinished) runs once more dead
    and comes back as SKIPPED_TOKEN: the matcher neither takes nor rejects it."""
    grammar = compiler.compile(Constraint("ebnf", 'root ::= "yes" | "no"')).result(timeout=30)
    matchers = GrammarMatchers(VOCAB)
    matchers.start(0, grammar)
    first = ids(tokenizer, "yes")[0]
    before = allowed_ids(matchers.fill([0]))
    assert matchers.accept([0], [SKIPPED_TOKEN]) == [False]
    assert allowed_ids(matchers.fill([0])) == before and not caplog.records
    assert matchers.accept([0], [first]) == [False]  # the matcher is where it was
