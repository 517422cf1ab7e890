"""Random-word prompts of an exact token count by the server's own tokenizer (POST /v1/tokenize
or /tokenize), approximated at 1.3 tokens per word where the server has no such endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Sequence

import httpx

from serving.client import Prompt

# Common English words: realistic for a real tokenizer (≈1.3 tokens each), and with a
# whitespace-splitting pre-tokenizer each word's tokens do not depend on its neighbours. (A
# string, not a list literal: the formatter would put each word on a line of its own.)
WORDS = """
the of and to in is was for that with as on by at from his an were are which this be or had
not but first one their its new after who they have her she two been other when there all
during into school time may years more most only over city some world would where later up
such used many can state about national out known university united then made also american
both these three between team well several part film since war century group
system number people water game season work series house music early river small
life long great right year place high light power area family open point order field
study market model value change story answer table window garden letter summer winter morning
""".split()  # noqa: SIM905
APPROX_TOKENS_PER_WORD = 1.3
# Appended to top a prompt up to its exact token count; the first that adds one token per copy.
FILLERS = (" a", " the", " x", " .", ".")
CALIBRATION_WORDS = 256
TOKENIZE_CONCURRENCY = 8
TOKENIZE_PATHS = ("/v1/tokenize", "/tokenize")


class PromptMaker:
    """Random-word prompts of an exact token count by the server's tokenizer, when it has one."""

    def __init__(self, http: httpx.AsyncClient, model: str) -> None:
        self.http = http
        self.model = model
        self.path: str | None = None  # the tokenize endpoint, None = approximate
        self.tokens_per_word = APPROX_TOKENS_PER_WORD
        self.filler: str | None = None
        self.limit = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    @property
    def source(self) -> str:
        return f"server {self.path}" if self.path else "approximate (no tokenize endpoint)"

    async def setup(self, rng: random.Random) -> None:
        for path in TOKENIZE_PATHS:
            self.path = path
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                if await self.count("hello world") > 0:
                    break
            self.path = None
        if self.path is None:
            return
        sample = " ".join(rng.choice(WORDS) for _ in range(CALIBRATION_WORDS))
        self.tokens_per_word = await self.count(sample) / CALIBRATION_WORDS
        base = await self.count("hello")
        for filler in FILLERS:
            if await self.count("hello" + filler * 8) == base + 8:
                self.filler = filler
                break

    async def count(self, text: str) -> int:
        assert self.path is not None
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        async with self.limit:
            response = await self.http.post(self.path, json=body)
        response.raise_for_status()
        out = response.json()
        return int(out["count"]) if "count" in out else len(out["tokens"])

    async def make(self, rng: random.Random, length: int) -> Prompt:
        guess = max(1, round(length / self.tokens_per_word))
        words = [rng.choice(WORDS) for _ in range(2 * guess + 16)]
        if self.path is None:
            return Prompt(" ".join(words[:guess]), length)

        async def tokens(n: int) -> int:
            while len(words) < n:
                words.extend(rng.choice(WORDS) for _ in range(n))
            return await self.count(" ".join(words[:n]))

        # The longest prefix of `words` with at most `length` tokens. Each probe's error, in
        # words, points one word past the target; bisection takes over once the bracket is
        # known and the estimate falls outside it.
        lo, lo_tokens = 0, 0  # tokens(lo) <= length
        hi: int | None = None  # tokens(hi) > length
        n = guess
        while hi is None or hi - lo > 1:
            got = await tokens(n)
            jump = (length - got) / self.tokens_per_word
            if got <= length:
                lo, lo_tokens = n, got
                n += math.ceil(jump) + 1
            else:
                hi = n
                n += math.floor(jump) - 1
            if hi is not None and not lo < n < hi:
                n = (lo + hi) // 2
        text = " ".join(words[:lo])
        short = length - lo_tokens
        if short and self.filler is not None:
            topped = (text + self.filler * short) if text else (self.filler * short).lstrip()
            if await self.count(topped) == length:
                return Prompt(topped, length)
        return Prompt(text, lo_tokens)

    async def make_many(self, rng: random.Random, lengths: Sequence[int]) -> list[Prompt]:
        # One generator per prompt, drawn up front: the words then do not depend on the order in
        # which concurrent tokenize calls come back.
        rngs = [random.Random(rng.getrandbits(64)) for _ in lengths]
        return list(
            await asyncio.gather(*(self.make(r, n) for r, n in zip(rngs, lengths, strict=True)))
        )


def input_lengths(rng: random.Random, count: int, mean: int, spread: float, dist: str) -> list[int]:
    """`count` prompt lengths: `fixed` (all `mean`), `uniform` (mean ± spread) or `normal`."""
    if dist == "fixed":
        return [mean] * count
    if dist == "uniform":
        return [
            rng.randint(max(1, round(mean - spread)), round(mean + spread)) for _ in range(count)
        ]
    return [max(1, round(rng.gauss(mean, spread))) for _ in range(count)]
