"""Launch parameters of the attention kernels, and the facts about the device they depend on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
import triton

# softmax runs on exp2: scores are pre-multiplied by log2(e) so exp2(s - m) == exp(s' - m').
LOG2E = 1.4426950408889634

# Requests with at most this many new tokens per step take the split-K decode path.
DECODE_MAX_EXTEND = 16


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters. The defaults target an H200 at the model's shapes (D 128, page 128)."""

    path: Literal["auto", "decode", "prefill"] = "auto"
    decode_block_n: int = 64  # keys per inner step of a split
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    num_splits: int = 0  # 0: derive from shapes so the grid covers programs_per_sm × SMs
    programs_per_sm: int = 2
    max_splits: int = 64
    prefill_block_m: int = 128  # rows per tile = tokens × padded GQA group
    prefill_block_n: int = 64
    prefill_num_warps: int = 8
    prefill_num_stages: int = 2
    # Programmatic dependent launch (sm_90+): the merge kernel is launched while the split
    # kernel still runs and waits on the device, hiding one launch latency per call.
    decode_pdl: bool = True
    # A step that prefills (longest extend past DECODE_MAX_EXTEND) with at least this many
    # decode rows (one new token each) in front: those rows take the decode kernel and only
    # the rest the prefill tiles, where each decode row fills a tile of its own. 0 (off): on an
    # H100 (2026-12-05, 4-layer slice, 1.2K contexts) the decode kernel took back what the prefill
    # kernel saved (64 + 32 tokens: 3.58 -> 3.60 ms of kernels) and the second path cost the host
    # 0.45-1.3 ms a step; served at C 16 and 64 it lost 2-4 % (perf/results/h100_h200_2026-12-05
    # _mixed_gil/README.md).
    mixed_decode_min_rows: int = 0


DEFAULT_CONFIG = AttentionConfig()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


@cache
def sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_supported(t: torch.Tensor) -> bool:
    return not interpreted(t) and sm90(t.device.index or 0)


def page_chunk(page_size: int, wanted: int) -> int:
    # Never straddle a page; at least 16 so every tl.dot dimension compiles on the GPU.
    return max(16, min(next_pow2(wanted), next_pow2(page_size)))
