"""The prompt tokens finished requests needed prefilled per output token, and the cap on a
mixed step's prompt budget it gives (`--mixed-step-demand-margin`; off by default).

The stretch (core/mixed_budget.py) holds a step that decodes to a few decode steps' time. Where
a mixed step's cost is mostly fixed (its launch on a slow host, a model of few layers) the
stretch cannot shorten its chunks: they stay at the floor, and the few long steps among many
short ones are the inter-token p99. On an H200's host serving 16 streams of 1184-token prompts
and 256 outputs, ~17 % of the steps carried ~270 prompt tokens in 4.6 ms beside decode steps of
1.3 ms: p99 / p50 5.1 (perf/results/h200_2026-12-07_mixed_launch/, calls A and B). Chunks sized
to what the batch consumes (its decode rows x the prompt tokens a request needed per output
token, x a margin) spread the same prefill over most steps: 96-token chunks there gave p99 / p50
1.96 for 5.6 % fewer output tokens/s. The cap grows with the batch, so a bigger one keeps the
budget its stretch and floor give; as a global floor, the same 96 tokens cost 64 streams 36 %
of their output tokens/s.

The ratio is a running mean over finished requests (prompt tokens computed, not found cached;
output tokens), so it follows the load; until `MIN_REQUESTS` have finished there is no cap.
"""

from __future__ import annotations

import math

WEIGHT = 0.05  # a finished request's share of the running means
MIN_REQUESTS = 8


class PrefillDemand:
    def __init__(self, margin: float) -> None:
        """`margin`: the cap's factor on the tokens the batch consumes (above 1: prompts are
        prefilled faster than rows finish, so the batch refills)."""
        if margin <= 0:
            raise ValueError(f"the demand margin must be positive, got {margin}")
        self.margin = margin
        self.prompt = 0.0  # running mean of a request's computed prompt tokens
        self.output = 0.0  # and of its output tokens
        self.requests = 0

    def note(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request finished after `output_tokens` outputs, `prompt_tokens` of its prompt
        computed (the rest came from the prefix cache)."""
        if output_tokens <= 0:
            return  # ended before its first token: it says nothing of the ratio
        self.requests += 1
        weight = max(WEIGHT, 1 / self.requests)  # a plain mean until the running one settles
        self.prompt += weight * (prompt_tokens - self.prompt)
        self.output += weight * (output_tokens - self.output)

    def per_output(self) -> float | None:
        """Prompt tokens computed per output token; None until enough requests finished."""
        if self.requests < MIN_REQUESTS:
            return None
        return self.prompt / self.output

    def cap(self, rows: int, quantum: int) -> int | None:
        """The most prompt tokens a step with `rows` decode rows carries: margin x rows x the
        ratio, up to whole quanta (one at least); None: no cap yet."""
        ratio = self.per_output()
        if ratio is None:
            return None
        return max(math.ceil(self.margin * ratio * rows / quantum) * quantum, quantum)
