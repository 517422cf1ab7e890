"""Host side of the NVFP4 MoE: the launch plan from shapes (route, tiles; a handful of compiled
variants per model shape) and the tuning overrides."""

from __future__ import annotations

import dataclasses
from typing import Literal

import triton

# Pair counts up to this can take the in-kernel "slots" route; each slot program scans all ids.
SLOTS_MAX_PAIRS = 512
# The auto route takes slots up to here and sorts above (on the H200 at 128 pairs, T = 32:
# 1465 µs slots vs 1171 µs sorted; at 32 pairs the two are within 4 %).
SLOTS_AUTO_MAX_PAIRS = 32
# Padded pair-vector sizes of the slots route (the compiled variants).
_SLOT_PAIR_BUCKETS = (32, 128, SLOTS_MAX_PAIRS)


# Values of the ROUTE constexpr (the kernels compare against the literals).
ROUTE_SLOTS = 0
ROUTE_SORTED = 1


@dataclasses.dataclass(frozen=True)
class NVFP4MoEConfig:
    """Overrides for tests and benchmarks; the defaults pick everything from shapes."""

    route: Literal["auto", "slots", "sorted"] = "auto"
    # "asm": inline-PTX nibble decode (GPU only); "triton": plain Triton ops (slower, same values).
    dequant: Literal["auto", "asm", "triton"] = "auto"
    pdl: bool = True
    # Tile overrides for tuning sweeps (0: the plan's). block_m: pairs per program (a power of
    # two >= 16); block_n: weight rows per program (a power of two >= 64: 64 per warpgroup of
    # MMA); block_k: K step (a power of two in [32, 256]).
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0


DEFAULT_CONFIG = NVFP4MoEConfig()


@dataclasses.dataclass(frozen=True)
class Plan:
    route: int
    block_m: int
    gate_up_n: int  # weight rows per program: half gate, half up
    down_n: int
    block_k_h: int  # K tile over H (gate_up)
    block_k_i: int  # K tile over I (down)
    num_warps: int
    num_stages: int
    p_pad: int  # slots route: padded pair vector


def _block_k(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing k (k is a multiple of 32)."""
    bk = cap
    while k % bk:
        bk //= 2
    return bk


def plan_moe(num_pairs: int, num_experts: int, hidden: int, inter: int, route: str) -> Plan:
    """Tiles from shapes only (a handful of compiled variants per model shape)."""
    use_slots = route == "slots" or (route == "auto" and num_pairs <= SLOTS_AUTO_MAX_PAIRS)
    if use_slots:
        if num_pairs > SLOTS_MAX_PAIRS:
            raise ValueError(f"the slots route takes at most {SLOTS_MAX_PAIRS} pairs")
        p_pad = next(b for b in _SLOT_PAIR_BUCKETS if num_pairs <= b)
        # Decode: memory-bound. 64-row weight tiles (one warpgroup MMA), 16 pairs (the smallest
        # MMA N), K steps of 128 (measured on the H200: 93.7 -> 75.2 µs at T = 1 vs 256).
        return Plan(
            ROUTE_SLOTS, 16, 64, 64, _block_k(hidden, 128), _block_k(inter, 128), 4, 3, p_pad
        )
    # Prefill: BLOCK_M near the mean pairs per expert bounds the padding; big tiles once the
    # blocks are full, since the decode cost of a weight tile is shared by its BLOCK_M pairs.
    mean = -(-num_pairs // num_experts)
    block_m = min(max(triton.next_power_of_2(mean), 16), 128)
    if block_m >= 64:
        return Plan(
            ROUTE_SORTED, block_m, 128, 128, _block_k(hidden, 128), _block_k(inter, 128), 8, 3, 0
        )
    return Plan(ROUTE_SORTED, block_m, 64, 64, _block_k(hidden, 256), _block_k(inter, 256), 4, 3, 0)


def overridden(plan: Plan, config: NVFP4MoEConfig) -> Plan:
    """The plan with the config's non-zero tile overrides applied (tuning sweeps only)."""
    changes: dict[str, int] = {}
    if config.block_m:
        changes["block_m"] = config.block_m
    if config.block_n:
        changes.update(gate_up_n=config.block_n, down_n=config.block_n)
    if config.block_k:
        changes.update(block_k_h=config.block_k, block_k_i=config.block_k)
    if config.num_warps:
        changes["num_warps"] = config.num_warps
    if config.num_stages:
        changes["num_stages"] = config.num_stages
    return dataclasses.replace(plan, **changes)
