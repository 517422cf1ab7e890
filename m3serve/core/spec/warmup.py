"""The warm-up plans of an engine with speculative decoding: the step shapes only verify steps
make, run through the same `SpecStep` a real step takes, after the plain plans
(core/warmup.py), before the server reports ready and before any graph is captured.

A verify row is 1 + γ tokens after a context, so its target kernels see extends of 1 + γ per
row, and the draft's block attention sees one block per verify row over the batch's page table.
Their launch choices depend on the number of verify rows R (the draft attention's split count,
`draft_num_splits`, is a function of R and the page-table width only; the kernel compiles once
split and once not), the page-table width, the step's tokens and its longest extend. So the
plans cross, on the same threshold grids as the plain ones (`shape_points`): R verify rows at
every context class, greedy, sampled and mixed (the greedy proposal and the sampled one differ);
plain decode rows beside verify rows (penalties, logprobs and grammars keep a request off
speculation); and verify rows beside a prefill chunk at short and long contexts. Plain prefills
and decodes need nothing here: with speculation on, the plain plans already run through
`SpecStep` (which keys their tokens into the draft's KV).

Every row starts a request and its slot's committed length is placed at the row's start
(`SlotLengths.place`) just before the plan runs; the KV written is garbage that real requests
overwrite, as with the plain plans.
"""

from __future__ import annotations

from collections.abc import Iterator

from m3serve.core.warmup import (
    GREEDY,
    SAMPLED,
    PlanBuilder,
    WarmupLimits,
    near_power_of_two,
    shape_points,
)
from m3serve.runtime.messages import StepPlan


def spec_max_step_tokens(plain: int, slots: int, gamma: int, pool_tokens: int) -> int:
    """The most tokens a step with speculation can carry: `plain` (a prefill budget and one
    token per slot) plus γ drafts per slot."""
    return min(plain + slots * gamma, pool_tokens)


def spec_warmup_plans(limits: WarmupLimits, gamma: int) -> Iterator[StepPlan]:
    """Plans with verify rows of `gamma` drafts (rows of 1 + `gamma` tokens)."""
    block = gamma + 1
    page, most = limits.page_size, limits.max_step_tokens
    if limits.context < block + 1 or most < block:
        return
    # A verify row ends at a context of whole pages (the page-table width) and starts after at
    # least one token (its anchor follows a prompt).
    ends = sorted({min(p * page, limits.context) for p in shape_points(-(-limits.context // page))})
    ends = [end for end in ends if end > block]
    longest = ends[-1]
    short = min(max(page, block) + 1, longest)  # a context of one page and a bit
    rows = [r for r in shape_points(limits.max_running, dense_until=5) if r * block <= most]
    tokens = shape_points(most)
    chunks = [t for t in tokens if t <= 64 or near_power_of_two(t) or t == tokens[-1]]
    builder = PlanBuilder(limits)
    for r in rows:
        for end in ends:  # r verify rows at one context: greedy and sampled alternate
            yield builder.plan([(end - block, block)] * r, verify=r, draft=gamma)
        for params in (GREEDY, SAMPLED):  # all greedy (a graphable proposal), all sampled
            yield builder.plan([(longest - block, block)] * r, r, gamma, params)
        yield from _beside_decodes(builder, r, block, gamma, (short, longest))
        for t in chunks:  # r - 1 verify rows beside a prefill chunk, short and long contexts
            if r > 1 and (r - 1) * block + t <= most:
                yield builder.plan([(short - block, block)] * (r - 1) + [(0, t)], r - 1, gamma)
                chunk = [(max(longest - t, 0), t)]
                yield builder.plan([(longest - block, block)] * (r - 1) + chunk, r - 1, gamma)


def _beside_decodes(
    builder: PlanBuilder, r: int, block: int, gamma: int, ends: tuple[int, ...]
) -> Iterator[StepPlan]:
    """Of r rows, one, half or all but one plain decodes (extend 1) and the rest verify rows."""
    if r < 2:
        return
    for plain in sorted({1, r // 2, r - 1}):
        verify = r - plain
        for end in ends:
            seqs = [(end - block, block)] * verify + [(end - 1, 1)] * plain
            yield builder.plan(seqs, verify, gamma)
