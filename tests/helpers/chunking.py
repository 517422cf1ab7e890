"""Ways a detokenizer can deliver the same text, for checking that streaming parsers give the
one-shot result whatever the chunking."""

from __future__ import annotations

import itertools
import random
import re

# MiniMax special tokens the parsers see: a detokenizer always delivers each one whole.
SPECIAL = re.compile(r"(<mm:think>|</mm:think>|\]<\]minimax\[>\[)")


def token_pieces(text: str, seed: int) -> list[str]:
    """Roughly how a detokenizer delivers text: special tokens whole, other text 1-4 chars."""
    rng = random.Random(seed)
    pieces: list[str] = []
    for part in SPECIAL.split(text):
        if SPECIAL.fullmatch(part):
            pieces.append(part)
            continue
        while part:
            size = rng.randint(1, 4)
            pieces.append(part[:size])
            part = part[size:]
    return pieces


def cut(text: str, points: list[int]) -> list[str]:
    """The text cut at arbitrary character positions."""
    bounds = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def all_chunkings(text: str, seed: int, points: list[int]) -> list[list[str]]:
    """Whole, char by char, token-sized pieces and random cuts."""
    return [[text], list(text), token_pieces(text, seed), cut(text, points)]
