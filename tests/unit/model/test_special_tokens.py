"""The control-token list: real special tokens, and all of them but the legacy M2 tags."""

from __future__ import annotations

from m3serve.model.special_tokens import CONTROL_TOKENS
from m3serve.model.tiny.tokenizer import SPECIAL_TOKENS

LEGACY_TAGS = {"<think>", "</think>", "<tool_call>", "</tool_call>"}


def test_control_tokens_are_the_named_special_tokens_but_the_legacy_tags() -> None:
    named = {t for t in SPECIAL_TOKENS if not t.startswith("]<]reserved_")}
    assert set(CONTROL_TOKENS) == named - LEGACY_TAGS
    assert len(CONTROL_TOKENS) == len(set(CONTROL_TOKENS))
