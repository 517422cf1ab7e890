"""The warm-up pass: forwards over every step shape class a server can see, run before it
reports ready, so that no request ever waits for a Triton compile.

Every kernel launch decision (tile sizes, split counts, paths, the grid) is a function of a few
shape features of the step — new tokens T, requests B, the longest extend, the page-table width
(the batch's longest context in pages) — and changes only where one of them crosses a threshold.
Lengths that vary per request are `do_not_specialize` in the kernels, so what is left to compile
is one variant per threshold class. `shape_points` takes, for each feature, every small value
and then the values around every power of two and on a 1.25x grid above, which lands in every
class (the thresholds are powers of two or wide ranges); `warmup_plans` crosses them the way
steps combine them: prefills of one request, long-context prefills, decodes of B requests over
long contexts, mixed decode + prefill steps, and several prefills together.

The plans write their KV into pages of the still-empty pool; their contents are garbage that
the first real requests overwrite. tests/unit/core/test_warmup.py checks with Triton's own
specialization rules that random steps launch no kernel variant the warm-up did not. With
speculative decoding on, these plans run through the verify step and core/spec/warmup.py adds
the verify-step shapes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from m3serve.runtime.messages import SamplingParams, SeqStep, StepPlan

# One greedy and one sampling request shape, so both sampler paths are compiled.
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02)


@dataclass(frozen=True)
class WarmupLimits:
    page_size: int
    num_pages: int  # pages in the pool the plans may write to
    max_running: int  # slots
    max_step_tokens: int  # the most new tokens one step can carry
    context: int  # the longest request in tokens


def shape_points(limit: int, dense_until: int = 17) -> list[int]:
    """Every value up to `dense_until`, then 2^k - 1, 2^k, 2^k + 1 and a 1.25x grid, up to
    `limit` (included)."""
    points = set(range(1, min(dense_until, limit) + 1))
    power = 16
    while power <= 2 * limit:
        points.update((power - 1, power, power + 1))
        power *= 2
    value = float(dense_until)
    while value < limit:
        points.add(int(value))
        value *= 1.25
    points.add(limit)
    return sorted(p for p in points if 1 <= p <= limit)


def warmup_plans(limits: WarmupLimits) -> Iterator[StepPlan]:
    page = limits.page_size
    tokens = shape_points(limits.max_step_tokens)
    # Context matters through the page-table width: lengths of whole pages.
    context_pages = shape_points(-(-limits.context // page))
    contexts = [min(p * page, limits.context) for p in context_pages]
    batches = shape_points(limits.max_running, dense_until=5)
    # Beside decodes, a chunk's length matters to the attention kernels only through the mean
    # and longest extend, whose classes are powers of two: the dense grid is not needed.
    mixed = [t for t in tokens if t <= 64 or near_power_of_two(t) or t == tokens[-1]]
    builder = PlanBuilder(limits)
    for t in tokens:  # one prefill, from the start of the prompt
        yield builder.plan([(0, t)])
    # One prefill (or decode) after a cached prefix: some launch choices depend on the step's
    # tokens and its page-table width together (the top-k block selection's rows per program,
    # by the GPU's SM count), so every token class meets every width class.
    for ctx in contexts:
        for t in tokens:
            if t <= min(ctx, limits.max_step_tokens):
                yield builder.plan([(ctx - t, t)])
    longest = limits.context
    for b in batches:
        for ctx in contexts:  # b decodes at one context length
            yield builder.plan([(ctx - 1, 1)] * b)
        for t in mixed:  # b - 1 decodes beside a prefill chunk, short and long contexts
            if b > 1 and t + b - 1 <= limits.max_step_tokens:
                yield builder.plan([(page, 1)] * (b - 1) + [(0, t)])
                yield builder.plan([(longest - 1, 1)] * (b - 1) + [(max(longest - t, 0), t)])
        for extend in shape_points(limits.max_step_tokens // b, dense_until=2):
            if extend > 1:  # b prefills of one length, from the start and after a prefix
                yield builder.plan([(0, extend)] * b)
                yield builder.plan([(max(longest - extend, 0), extend)] * b)


def near_power_of_two(n: int) -> bool:
    return any((n + d) & (n + d - 1) == 0 for d in (-1, 0, 1))


class PlanBuilder:
    """Turns (start, extend) pairs into a plan over pages of the pool (reused when the pool is
    smaller than the contexts: the contents do not matter, only the shapes)."""

    def __init__(self, limits: WarmupLimits) -> None:
        self.limits = limits
        self.step = 0

    def plan(
        self,
        seqs: list[tuple[int, int]],
        verify: int = 0,
        draft: int = 0,
        params: SamplingParams | None = None,
    ) -> StepPlan:
        """The first `verify` rows are speculative verify rows of `draft` drafts (their extend
        is 1 + `draft`); rows alternate greedy and sampled unless `params` is given."""
        self.step += 1
        steps, sampling, prompts = [], {}, {}
        for slot, (start, extend) in enumerate(seqs):
            pages = self._pages(slot, start + extend)
            ids = [(slot + i) % 64 + 1 for i in range(extend)]
            if slot < verify:
                row = SeqStep(None, start, pages, slot, new_request=True, draft=draft)
            else:
                row = SeqStep(ids, start, pages, slot, sample=True, new_request=True)
            steps.append(row)
            sampling[slot] = params or (GREEDY if slot % 2 == 0 else SAMPLED)
            prompts[slot] = ids
        return StepPlan(step=-self.step, seqs=steps, sampling=sampling, prompt_ids=prompts)

    def _pages(self, slot: int, length: int) -> list[int]:
        count = -(-length // self.limits.page_size)
        first = slot * count
        return [(first + i) % self.limits.num_pages for i in range(count)]


def distinct_layers(layer_types: Sequence[str], mlp_layer_types: Sequence[str]) -> list[int]:
    """The first layer of each (attention, MLP) kind: layers of one kind launch the same
    kernels at the same shapes, so warming these compiles what every layer needs."""
    first: dict[tuple[str, str], int] = {}
    for i, kind in enumerate(zip(layer_types, mlp_layer_types, strict=True)):
        first.setdefault(kind, i)
    return sorted(first.values())


def use_kernel_cache(directory: Path) -> None:
    """Compiled kernels are written to, and reloaded from, `directory` (so a restart compiles
    nothing), unless TRITON_CACHE_DIR already names a directory."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return
    try:
        from triton import knobs
    except ImportError:  # no triton: nothing compiles
        return
    directory.mkdir(parents=True, exist_ok=True)
    knobs.cache.dir = str(directory)
