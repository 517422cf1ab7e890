"""What finished requests needed prefilled per output token, and the cap on a mixed step's
prompt budget it gives (core/prefill_demand.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m3serve.core.prefill_demand import MIN_REQUESTS, PrefillDemand


def finished(demand: PrefillDemand, prompt: int, output: int, times: int) -> None:
    for _ in range(times):
        demand.note(prompt, output)


def test_no_cap_until_enough_requests_finished() -> None:
    demand = PrefillDemand(1.3)
    finished(demand, 1184, 256, MIN_REQUESTS - 1)
    assert demand.per_output() is None and demand.cap(16, 32) is None
    demand.note(0, 0)  # ended before its first token: not counted
    assert demand.cap(16, 32) is None
    demand.note(1184, 256)
    assert demand.per_output() == pytest.approx(1184 / 256)


def test_the_cap_is_the_batch_consumption_times_the_margin_in_whole_quanta() -> None:
    """16 streams of 1184-token prompts and 256 outputs: 1.2 x 16 x 4.625 = 88.8 tokens -> 96
    (call B's chunks on the H200); 64 rows -> 384 (above the default floor of 256); one row -> a
    quantum."""
    demand = PrefillDemand(1.2)
    finished(demand, 1184, 256, MIN_REQUESTS)
    assert demand.cap(16, 32) == 96
    assert demand.cap(64, 32) == 384
    assert demand.cap(1, 32) == 32
    assert PrefillDemand(1.0).cap(1, 32) is None  # a fresh one caps nothing


def test_the_ratio_follows_the_load() -> None:
    """Prompts served from the prefix cache (fewer computed tokens) bring the ratio down."""
    demand = PrefillDemand(1.0)
    finished(demand, 1184, 256, 50)
    before = demand.per_output()
    finished(demand, 100, 256, 200)
    after = demand.per_output()
    assert before is not None and after is not None
    assert after < 0.5 < before == pytest.approx(4.625)


@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 2_000)), min_size=MIN_REQUESTS),
    st.integers(1, 256),
    st.sampled_from([16, 32, 128]),
)
def test_the_cap_covers_the_margin_times_the_consumption_in_whole_quanta(
    requests: list[tuple[int, int]], rows: int, quantum: int
) -> None:
    demand = PrefillDemand(1.5)
    for prompt, output in requests:
        demand.note(prompt, output)
    ratio = demand.per_output()
    cap = demand.cap(rows, quantum)
    assert ratio is not None and cap is not None
    assert cap % quantum == 0 and cap >= quantum
    wanted = 1.5 * ratio * rows
    assert cap >= wanted - 1e-9 and (cap == quantum or cap - quantum < wanted)


def test_the_margin_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        PrefillDemand(0.0)
