"""The prompt-token budget of a step that also decodes: the start-up measure, kept to its stretch
by the steps actually served.

`StepCost` (core/step_cost.py) times synthetic steps once at start, on an idle device and
without the overlap loop; served steps differ (contexts of every length, the checkpoint's
sampling, the next batch built while the device runs). On the H200 a 4-layer slice's start-up
measure gave a decode step of 16 rows 2.21 ms where served ones ran 1.99 ms, and so a budget of
384 prompt tokens whose mixed steps ran 2.76 decode steps, not 2.5: the inter-token p99 went to
3.3x its median. So each served step's time is fed back (on a GPU its kernels' device time,
core/device_clock.py: the run's wall time reads a step launched ahead short):
* pure decode steps keep a running mean of the decode step per batch bucket (from the start-up
  measure on; a slow step counts as at most 1.2x the mean), and a bucket's decode step is the
  least of its own and bigger buckets' (a bucket decoding alone rarely keeps its start-up time);
  a bucket no pure decode step has corrected yet takes its start-up time scaled as the nearest
  corrected bucket's moved. The start-up measure is a host's wall time around idle steps, the
  served one the device's, and the two differ by more than noise: an H100 measured 128 rows at
  4.05 ms at start where served ones ran ~2.5 ms of device time, so the first mixed steps of a
  128-stream level were judged against a stretch of 10.1 ms, grew their budget to ~1000 tokens
  and gave an inter-token p99 of 13.6 ms (9.2 on a server whose start-up measure read 3.42);
* a mixed step that ran over stretch x that decode step scales its bucket's budget down, and
  one that carried its whole budget with room for another quantum (at the start-up per-token
  cost, and 5 % to spare) scales it up, each by the square root of (prompt work wanted /
  prompt work seen) and by one quantum of the budget at least, damped to at most 1.25x up or
  0.8x down. So the budget settles on the most whole quanta (`budget_quantum`: 32 tokens) whose
  mixed steps stay within `stretch` decode steps, instead of hovering a quantum above.

A step planned while requests wait for a slot carries the budget of the batch admitting them
fills to (`Scheduler._batch_ahead`), and is judged as that batch's step: its time plus the
decode work of the rows it lacked (the served decode means, grown past the largest measured
batch along the last slope, as `StepCost.decode` does).

The budget never leaves [1/8, 4] x the start-up one nor drops below one quantum, so a prompt
always advances and one odd step (a garbage collection, a cold cache) moves it by one damped
step only. `min_tokens` (`--mixed-step-min-tokens`) sets a higher floor: a step's cost is not
the line the start-up fit draws but a staircase with a fixed part (leaving the decode graph,
the kernels' M thresholds), and where that fixed part alone fills the stretch every mixed step
runs over it whatever it carries, so the feedback walks the budget down to one quantum and
prompts prefill several times slower for nothing (an H100, 12-05: beside 16 decode rows, steps
of 0-63 and of 192-255 prompt tokens both ran 4.6 ms, the stretch 4.58). The served default is
256 (the same H100: 29 % more output tokens/s at 16 streams, inter-token p99/p50 2.91 for 3.73).

With a `demand` (`--mixed-step-demand-margin`) each budget is also capped at what its batch
consumes (core/prefill_demand.py); a step held to that cap leaves the stretch's scale alone.
"""

from __future__ import annotations

import logging
import math
import time

from m3serve.core.prefill_demand import PrefillDemand
from m3serve.core.step_cost import StepCost, bucket, envelope, whole_quanta

log = logging.getLogger(__name__)

# A step carried its budget when its prompt tokens reached this share of it (chunks are whole
# quanta, the last chunk of a prompt may be short).
FULL_SHARE = 0.75
EWMA = 0.1  # the weight of a new decode step in its bucket's running mean
# A slow decode step (a collection, a hiccup) counts as at most this many times the mean: the
# mean is what a typical gap is, and a raised one would let the budget grow past the stretch.
DECODE_CLIP = 1.2
# A quantum more is taken only if the step would stay this far inside the stretch: the gap a
# client sees adds host time and jitter to the step (on the H200 at 16 streams, mixed steps at
# 2.9 decode steps gave an inter-token p99 of 3.0x the median).
GROW_BELOW = 0.95
STEP_UP, STEP_DOWN = 1.25, 0.8  # the most one mixed step moves its bucket's budget
SCALE_MIN, SCALE_MAX = 0.125, 4.0
REPORT_S = 30.0  # the least time between two log lines of the budgets


class MixedBudget:
    """Callable as the scheduler's `mixed_budget(decodes)`; `observe` is fed every step run."""

    def __init__(
        self,
        cost: StepCost,
        stretch: float,
        quantum: int,
        min_tokens: int = 0,
        demand: PrefillDemand | None = None,
    ) -> None:
        """`demand`: caps each budget at what its batch consumes (core/prefill_demand.py)."""
        self.cost = cost
        self.demand = demand
        self.stretch = stretch
        self.quantum = quantum
        self.floor = whole_quanta(min_tokens, quantum)
        self.sizes = sorted(cost.decode_ms)
        self.decode_ms = dict(cost.decode_ms)  # bucket -> running mean of served decode steps
        self.corrected: set[int] = set()  # buckets whose mean served decode steps have moved
        self.scale = dict.fromkeys(self.sizes, 1.0)  # bucket -> factor on the start-up budget
        self._reported = [self(b) for b in self.sizes]
        self._reported_at = 0.0

    def __call__(self, decodes: int) -> int:
        budget = self._uncapped(decodes)
        cap = self._cap(decodes)
        return budget if cap is None else min(budget, cap)

    def _cap(self, decodes: int) -> int | None:
        """The demand's cap on the budget (None: none)."""
        return self.demand.cap(decodes, self.quantum) if self.demand is not None else None

    def _uncapped(self, decodes: int) -> int:
        """The budget of the stretch and the floor."""
        return max(whole_quanta(self._unrounded(decodes), self.quantum), self.floor)

    def _unrounded(self, decodes: int) -> float:
        """The budget before it is cut to whole quanta: the start-up one times the scale."""
        start = self.cost.mixed_budget(decodes, self.stretch, self.quantum)
        return start * self.scale[bucket(self.sizes, decodes)]

    def observe(self, decodes: int, prompt_tokens: int, ms: float, sized_for: int = 0) -> None:
        """One step run: `decodes` decode rows and `prompt_tokens` prompt tokens in `ms`, its
        budget sized for a batch of `sized_for` rows (the scheduler's `_batch_ahead`; 0: its
        own). A step sized for a batch still filling is judged as that batch's step: its time
        plus the decode work of the rows it lacked."""
        if decodes == 0 or ms <= 0:
            return  # a step that decodes nothing stretches no stream
        if prompt_tokens == 0:
            at = bucket(self.sizes, decodes)
            mean = self.decode_ms[at]
            self.decode_ms[at] += EWMA * (min(ms, DECODE_CLIP * mean) - mean)
            self.corrected.add(at)
            return
        # As the start-up budget does (StepCost.decode): no bucket's decode step counts as
        # slower than a bigger one's, so a bucket served rarely keeps no noisy start-up time.
        means = self.served_means()
        decode = envelope(means, max(decodes, sized_for))
        if sized_for > decodes:
            ms += decode - envelope(means, decodes)
            decodes = sized_for
        at = bucket(self.sizes, decodes)
        limit = self.stretch * decode
        tokens = self._uncapped(decodes)
        cap = self._cap(decodes)
        if cap is not None and cap < tokens:
            return  # held to the demand's cap: the step says nothing of the stretch's budget
        if prompt_tokens < FULL_SHARE * tokens and ms <= limit:
            return  # a short chunk says nothing about what the budget would cost
        over = limit < ms
        if over and tokens <= self.floor:
            return  # at the floor: a smaller budget is not allowed, so the scale stays put
        if over or ms + self.quantum * self.cost.prefill_ms_per_token <= GROW_BELOW * limit:
            # Over the stretch: down; a quantum more would still fit: up. Each by the damped
            # ratio of the prompt work wanted to the work seen, and by a quantum at least: next
            # to the stretch that ratio is near 1, and the budget is whole quanta, so steps of
            # it alone could leave the budget where it is for hundreds of steps.
            step = math.sqrt((limit - decode) / max(ms - decode, 1e-3))
            unrounded = self._unrounded(decodes)
            if over:  # half a token past a quantum boundary, against rounding
                step = min(step, (tokens - 0.5) / unrounded)
            else:
                step = max(step, (tokens + self.quantum + 0.5) / unrounded)
            step = min(max(step, STEP_DOWN), STEP_UP)
            self.scale[at] = min(max(self.scale[at] * step, SCALE_MIN), SCALE_MAX)
            self._report()

    def served_means(self) -> dict[int, float]:
        """Each bucket's decode step as served: its running mean once decode steps of its size
        have corrected it, before that its start-up time times the ratio the nearest corrected
        bucket (the smaller of two as near) moved by; the start-up times while none is."""
        if not self.corrected:
            return self.decode_ms
        means = {}
        for size in self.sizes:
            if size in self.corrected:
                means[size] = self.decode_ms[size]
                continue
            near = min(self.corrected, key=lambda c: (abs(c - size), c))
            means[size] = (
                self.cost.decode_ms[size] * self.decode_ms[near] / self.cost.decode_ms[near]
            )
        return means

    def __str__(self) -> str:
        """The budgets now and the served decode steps they follow, per bucket."""
        means = self.served_means()
        return ", ".join(f"{b}: {means[b]:.2f} ms -> {self(b)}" for b in self.sizes)

    def _report(self) -> None:
        """Log the budgets when they moved since the last report, at most every REPORT_S
        (where they settle, without the step trace)."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_S:
            return  # the clock first: the budgets are worked out only when a line may go out
        budgets = [self(b) for b in self.sizes]
        if budgets != self._reported:
            self._reported, self._reported_at = budgets, now
            log.info("mixed-step prompt budget now (decode batch: step -> tokens): %s", self)
