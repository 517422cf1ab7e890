"""What steps cost on this device, measured once at start, and from it the prompt-token budget
of a step that also decodes.

Every running request waits for each step, so a step that carries prompt chunks stretches the
inter-token gap of every decode in it. Capping those chunks so that a mixed step takes at most
`stretch` times a pure decode step of the same batch (Sarathi-Serve's stall-free batching)
bounds the gap's tail: with stretch 2.5, ITL p99 stays within 3x its median. A step with no
decodes keeps the whole `--chunked-prefill-size` budget: nobody is waiting on it.

The measurement is a handful of timed forwards after the CUDA graphs are captured: decode
steps at each captured batch size over a short context, prefills of a few lengths, fitted to a
per-token cost, and one mixed step (decode rows plus a short chunk), whose time beyond its
decode rows and its tokens is the fixed cost of leaving the decode graph: the prompt path's
eager and piecewise launches. On the H200 that fixed part is about one decode step (a 4-layer
slice: 1.9 ms, against 2.1 ms for a decode step at batch 16), so a budget from the per-token
cost alone lets a short chunk stretch a step well past `stretch`. The measured rows carry
distinct token ids (rows of one token would all route to the same few experts, where served
rows spread over many) and draw with the checkpoint's default sampling (the caller's `forward`).
Budgets are rounded to whole quanta of 32 tokens (`budget_quantum`), so a restart on the same
machine lands on the same budgets, and never drop below one quantum, so a prompt always
advances. A quantum smaller than a page: where one page of prompt already stretches a step past
`stretch` (on the H200 a 4-layer slice's 16 decode rows ran 1.9 ms alone, 4.7 ms beside a
128-token chunk and 3.6 ms beside 32-63 tokens), the budget can still go lower. Chunks need not
end on a page: the next chunk, like a decode, continues the last page.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

from m3serve.runtime.messages import SeqStep

# The budget's step in tokens (see the module docstring): the M granularity of the MMA tiles
# twice over, a quarter of a 128-token page.
QUANTUM = 32


def budget_quantum(page: int) -> int:
    """The budget's step for a KV page of `page` tokens: `QUANTUM`, or the page if smaller."""
    return min(QUANTUM, page)


def whole_quanta(tokens: float, quantum: int) -> int:
    """`tokens` cut to whole quanta, and one quantum at least (a prompt always advances)."""
    return max(int(tokens) // quantum * quantum, quantum)


@dataclass(frozen=True)
class StepCost:
    decode_ms: dict[int, float]  # batch size -> ms of a pure decode step
    prefill_ms_per_token: float  # the marginal cost of one prompt token
    mixed_fixed_ms: float = 0.0  # what a step pays for carrying any prompt chunk at all

    def decode(self, batch: int) -> float:
        """The step time of the smallest measured batch >= `batch` (past the largest, grown
        along the last measured slope: `envelope`), or of a bigger batch where that measured
        faster: more rows never make a step faster, so a smaller batch timed slower is noise
        (on the H200, 12 rows once timed 2.27 ms where 16 timed 1.98), and its budget would
        let mixed steps run past the stretch."""
        return envelope(self.decode_ms, batch)

    def mixed_budget(self, decodes: int, stretch: float, quantum: int) -> int:
        """Prompt tokens a step with `decodes` decode rows may carry, in whole `quantum`s
        (`budget_quantum`)."""
        extra_ms = (stretch - 1.0) * self.decode(decodes) - self.mixed_fixed_ms
        return whole_quanta(max(extra_ms, 0.0) / self.prefill_ms_per_token, quantum)

    def describe(self, stretch: float, quantum: int) -> str:
        budgets = ", ".join(
            f"{b}: {ms:.2f} ms -> {self.mixed_budget(b, stretch, quantum)}"
            for b, ms in sorted(self.decode_ms.items())
        )
        return (
            f"mixed-step prompt budget (stretch {stretch:g}; decode batch: step -> tokens): "
            f"{budgets}; prefill {1e3 * self.prefill_ms_per_token:.1f} us/token, "
            f"{self.mixed_fixed_ms:.2f} ms fixed per mixed step"
        )


def bucket(sizes: list[int], batch: int) -> int:
    """The smallest of the sorted measured batch `sizes` >= `batch` (the largest past them)."""
    return sizes[min(bisect.bisect_left(sizes, batch), len(sizes) - 1)]


def envelope(step_ms: dict[int, float], batch: int) -> float:
    """The least step time of the measured batches >= `batch`; past the largest, its time grown
    along the slope of the two largest (a decode step past the graphs' biggest batch still
    reads the weights once and adds each row's attention: taken as the largest batch's time,
    a batch twice as big would be budgeted half the prompt tokens its step can carry)."""
    sizes = sorted(step_ms)
    time = min(step_ms[s] for s in sizes if s >= bucket(sizes, batch))
    if batch <= sizes[-1] or len(sizes) < 2:
        return time
    last, before = sizes[-1], sizes[-2]
    slope = max(step_ms[last] - step_ms[before], 0.0) / (last - before)
    return time + slope * (batch - last)


def fit_per_token(samples: dict[int, float]) -> float:
    """The least-squares slope (ms per token) of prefill time against length."""
    n = len(samples)
    mean_t = sum(samples) / n
    mean_ms = sum(samples.values()) / n
    cov = sum((t - mean_t) * (ms - mean_ms) for t, ms in samples.items())
    var = sum((t - mean_t) ** 2 for t in samples)
    if var == 0 or cov <= 0:
        return max(mean_ms / mean_t, 1e-6)
    return cov / var


def best_ms(run: Callable[[], None], sync: Callable[[], None], repeats: int = 3) -> float:
    """The fastest of `repeats` timed runs after one untimed one, in ms."""
    run()
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        best = min(best, 1e3 * (time.perf_counter() - started))
    return best


DECODE_CONTEXT = 1024  # tokens of context behind each measured decode row
PREFILL_LENGTHS = (256, 512, 1024, 2048)


def measure_step_cost(
    forward: Callable[[list[SeqStep]], None],
    sync: Callable[[], None],
    decode_sizes: list[int],
    page: int,
    num_pages: int,
    max_step_tokens: int,
    vocab_size: int,
) -> StepCost:
    """Time `forward` on synthetic decode, prefill and mixed steps over the (still unused) KV
    pool, with token ids spread over `vocab_size` (so rows route as served ones do)."""
    ids = _TokenIds(vocab_size)
    decode_ms = {}
    for size in decode_sizes:
        seqs = _decode_rows(size, page, num_pages, ids)
        decode_ms[size] = best_ms(lambda seqs=seqs: forward(seqs), sync)
    longest = min(max_step_tokens, num_pages * page)
    prefill_ms = {}
    for length in [n for n in PREFILL_LENGTHS if n <= longest] or [longest]:
        seq = SeqStep(ids.take(length), 0, list(range(-(-length // page))))
        prefill_ms[length] = best_ms(lambda seq=seq: forward([seq]), sync)
    per_token = fit_per_token(prefill_ms)
    fixed = 0.0
    size = decode_sizes[len(decode_sizes) // 2] if decode_sizes else 0
    chunk = MIXED_PROBE_PAGES * page
    if size and chunk <= max_step_tokens - size and num_pages - MIXED_PROBE_PAGES >= size:
        rows = _decode_rows(size, page, num_pages - MIXED_PROBE_PAGES, ids, MIXED_PROBE_PAGES)
        seqs = [SeqStep(ids.take(chunk), 0, list(range(MIXED_PROBE_PAGES))), *rows]
        mixed = best_ms(lambda: forward(seqs), sync)
        fixed = max(0.0, mixed - decode_ms[size] - per_token * chunk)
    return StepCost(decode_ms, per_token, fixed)


# Pages of prompt in the mixed step that measures the fixed cost (a short chunk, as a tight
# budget carries).
MIXED_PROBE_PAGES = 2


class _TokenIds:
    """Token ids that differ from one to the next, the same sequence on every start (a fixed
    stride through the vocabulary, co-prime to any vocabulary size that is not a multiple of
    its prime stride)."""

    STRIDE = 7919

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = max(vocab_size, 1)
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = [(self.next + i * self.STRIDE) % self.vocab_size for i in range(n)]
        self.next = (self.next + n * self.STRIDE) % self.vocab_size
        return out


def _decode_rows(
    size: int, page: int, num_pages: int, ids: _TokenIds, first: int = 0
) -> list[SeqStep]:
    """`size` decode rows over distinct pages from `first` on (at most `num_pages` of them),
    each with its own token."""
    each = max(1, min(DECODE_CONTEXT // page, num_pages // size))
    return [
        SeqStep(ids.take(1), each * page - 1, list(range(first + i * each, first + (i + 1) * each)))
        for i in range(size)
    ]
