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
# Up to here (one token's top-4) the slots route takes narrow tiles, two K tiles a step.
_NARROW_MAX_PAIRS = 4
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
    # two >= 16); block_n: weight rows per program (a power of two >= 32: 64 per warpgroup of
    # wgmma; at 32, mma.sync, measured much slower). A tile's K width is not a choice: it is
    # the weights' K tile (`nvfp4_tiles.tile_k`), the period of the activations' MMA K order;
    # how many tiles a K loop step takes is.
    block_m: int = 0
    block_n: int = 0
    num_warps: int = 0
    num_stages: int = 0
    # Weight tiles per K loop step (0: the plan's; reduced to a count dividing both projections').
    k_tiles: int = 0
    # Programs each projection's K is split over (0: the plan's; reduced to a count dividing both
    # projections' loop steps): more programs per weight column for few tokens.
    split_k: int = 0
    # Sorted route: pairs an expert's last block takes past block_m with the same decoded
    # weights (-1: the plan's; 0: none; else a power of two >= 16).
    tail_m: int = -1
    # Registers a thread may use (-1: the plan's; 0: the compiler's choice).
    max_registers: int = -1


DEFAULT_CONFIG = NVFP4MoEConfig()


@dataclasses.dataclass(frozen=True)
class Plan:
    route: int
    block_m: int
    gate_up_n: int  # weight rows per program: half gate, half up
    down_n: int
    num_warps: int
    num_stages: int
    p_pad: int  # slots route: padded pair vector
    k_tiles: int = 1  # weight tiles per K loop step
    split_k: int = 1  # programs over each projection's K (their partial sums added in order)
    tail_m: int = 0  # sorted route: an expert's last block's pairs past block_m (its tail)
    max_registers: int = 0  # a thread's registers, capped (0: the compiler's choice)


def plan_moe(num_pairs: int, num_experts: int, route: str) -> Plan:
    """Tiles from shapes only (a handful of compiled variants per model shape)."""
    use_slots = route == "slots" or (route == "auto" and num_pairs <= SLOTS_AUTO_MAX_PAIRS)
    if use_slots:
        if num_pairs > SLOTS_MAX_PAIRS:
            raise ValueError(f"the slots route takes at most {SLOTS_MAX_PAIRS} pairs")
        p_pad = next(b for b in _SLOT_PAIR_BUCKETS if num_pairs <= b)
        # Decode: memory-bound, 16 pairs a program (the smallest MMA N). One token's 4 experts
        # give few programs: 64-row weight tiles (one warpgroup MMA) and two K tiles a step keep
        # more bytes in flight (H200, T = 1: 56.8 µs vs 62.8 one tile a step, 66.1 with
        # 128 rows). With more experts, 128-row tiles share each step's fixed costs over twice
        # the bytes (T = 8: 319.8 µs vs 343.9). `perf/bench_nvfp4_moe.py --ablations` times
        # these choices.
        if num_pairs <= _NARROW_MAX_PAIRS:
            return Plan(ROUTE_SLOTS, 16, 64, 64, 4, 3, p_pad, k_tiles=2)
        return Plan(ROUTE_SLOTS, 16, 128, 128, 4, 3, p_pad)
    # Prefill: BLOCK_M near the mean pairs per expert bounds the padding; big tiles once the
    # blocks are full, since the decode cost of a weight tile is shared by its BLOCK_M pairs.
    mean = -(-num_pairs // num_experts)
    block_m = min(max(triton.next_power_of_2(mean), 16), 128)
    # Routing is uneven: many experts get a few pairs more than a multiple of BLOCK_M, and a
    # block of their own would decode all their weights again for those. An expert's last block
    # takes up to TAIL_M more with its decoded tiles (`align.py`; H200, random top-4 of 128
    # experts, no tail -> tail: T 512 2125 -> 1703 µs, T 1024 2702 -> 2240, T 2048 3524 -> 2865
    # under the register cap that keeps two 8-warp programs an SM (3311 without it), T 4096
    # 6277 -> 5272 with a 32-pair tail, whose 229-235 registers leave the one program an SM
    # that no tail's 172-186 do; 2-3 % slower where no expert spills, e.g. T 3072;
    # perf/results/h200_2026-12-05_last_block_tail/, h200_h100_2026-12-05_prefill_tail/).
    if block_m == 128:
        return Plan(ROUTE_SORTED, block_m, 128, 128, 8, 3, 0, tail_m=32)
    if block_m == 64:
        return Plan(ROUTE_SORTED, 64, 128, 128, 8, 3, 0, tail_m=16, max_registers=128)
    if block_m == 16:  # T 32-64 on the H200: 128 weight rows a program, 7-8 % under 64
        return Plan(ROUTE_SORTED, block_m, 128, 128, 4, 3, 0, tail_m=16)
    return Plan(ROUTE_SORTED, block_m, 64, 64, 4, 3, 0, tail_m=16)


def overridden(plan: Plan, config: NVFP4MoEConfig) -> Plan:
    """The plan with the config's non-zero tile overrides applied (tuning sweeps only)."""
    changes: dict[str, int] = {}
    if config.block_m:
        changes["block_m"] = config.block_m
    if config.block_n:
        changes.update(gate_up_n=config.block_n, down_n=config.block_n)
    if config.num_warps:
        changes["num_warps"] = config.num_warps
    if config.num_stages:
        changes["num_stages"] = config.num_stages
    if config.k_tiles:
        changes["k_tiles"] = config.k_tiles
    if config.split_k:
        changes["split_k"] = config.split_k
    if config.tail_m >= 0 and plan.route == ROUTE_SORTED:
        changes["tail_m"] = config.tail_m
    if config.max_registers >= 0:
        changes["max_registers"] = config.max_registers
    return dataclasses.replace(plan, **changes)
