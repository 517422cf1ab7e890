"""Stop 38's off-line experiment (not in the package): the NVFP4 MoE's gate_up at one token as a
CUDA-core GEMV instead of the tensor-core tile, compiled for sm_90 without a GPU to count its
loop's instructions against the served kernel's. Each program owns 32 weight rows (16 gate, 16
up: one row group of the tiled layout), each thread 16 bytes of a row per K tile, decoded by
the same exact `_dequant`, multiplied by fp32 activations (stored split into even and odd
halves so each thread's are contiguous) and summed in registers.

    PYTHONPATH=$PWD /tmp/t36/bin/python perf/results/h100_2026-12-05_stop38/sm90_gemv_experiment.py

Result (Triton 3.6, 2026-12-05): 372 instructions per two K tiles per thread (32 weight bytes,
11.6 per byte: FFMA 64, bf16->fp32 conversions ~60, the decode ~170), 64 registers; the served
tile's K loop is ~509 per two tiles over 64 bytes a thread (8 per byte). Not pursued.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import triton
import triton.language as tl

# The project's packages after this interpreter's own Triton (3.6, as on the GPU machine).
sys.path.append("/work/venv/lib/python3.11/site-packages")
from m3serve.kernels.triton.nvfp4_moe.decode import ACC_SCALE, _dequant, _group_scales


@triton.jit
def _gemv_rows(xs_ptr, w_ptr, s_ptr, w_rows, k_end, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
               K_TILES: tl.constexpr, DEQUANT: tl.constexpr):  # fmt: skip
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    kb = tl.arange(0, HALF)
    kg = tl.arange(0, GROUPS)
    group = w_rows // 32
    lane = w_rows % 32
    w_tile = w_ptr + (group * (32 * (k_end // 2)) + lane * HALF)[:, None] + kb[None, :]
    s_tile = s_ptr + (group * (32 * (k_end // 16)) + lane * GROUPS)[:, None] + kg[None, :]
    evens = xs_ptr + kb[None, :]
    odds = evens + k_end // 2
    acc = tl.zeros([ROWS, HALF], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K * K_TILES):
        for u in tl.static_range(K_TILES):
            k = k0 + u * BLOCK_K
            b = tl.load(w_tile + k * 16)
            s = _group_scales(tl.load(s_tile + k * 2), DEQUANT)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], [ROWS, GROUPS, 8]), [ROWS, HALF])
            lo, hi = _dequant(b, s, DEQUANT, tl.bfloat16)
            acc += lo.to(tl.float32) * tl.load(evens + k // 2)
            acc += hi.to(tl.float32) * tl.load(odds + k // 2)
    return tl.sum(acc, axis=1)


@triton.jit
def gate_up_gemv_kernel(xs_ptr, ids_ptr, w_ptr, stride_we, s_ptr, stride_se, g_ptr, act_ptr,
                        hidden, inter, alpha, limit, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                        K_TILES: tl.constexpr, DEQUANT: tl.constexpr):  # fmt: skip
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    HALF_N: tl.constexpr = ROWS // 2
    r = tl.arange(0, ROWS)
    j = tl.program_id(0) * HALF_N + (r % HALF_N)
    is_up = r >= HALF_N
    rows = tl.where(is_up, inter + j, j)
    w_base, s_base = w_ptr + expert * stride_we, s_ptr + expert * stride_se
    acc = _gemv_rows(xs_ptr, w_base, s_base, rows, hidden, ROWS, BLOCK_K, K_TILES, DEQUANT)
    g = tl.where(is_up, tl.load(g_ptr + expert * 2 + 1), tl.load(g_ptr + expert * 2))
    gate, up = tl.split(tl.permute(tl.reshape(acc * g * ACC_SCALE, [2, HALF_N]), (1, 0)))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = (up + 1.0) * (gate * tl.sigmoid(alpha * gate))
    n = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
    tl.store(act_ptr + pair * inter + n, h.to(act_ptr.dtype.element_ty))


def main() -> None:
    spec = importlib.util.spec_from_file_location("sm90", "perf/sm90_resources.py")
    assert spec is not None and spec.loader is not None
    sm90 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sm90)
    args = argparse.Namespace(ptxas="/usr/local/cuda/bin/ptxas", sass=True)
    types = {"xs_ptr": "*fp32", "ids_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*fp8e4nv",
             "g_ptr": "*fp32", "act_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"}  # fmt: skip
    for k_tiles in (1, 2, 4):
        consts = {"ROWS": 32, "BLOCK_K": 128, "K_TILES": k_tiles, "DEQUANT": 0}
        sm90.report(f"gemv gate_up rows 32, {k_tiles} K tiles a step", gate_up_gemv_kernel,
                    types, consts, 4, args, 1)  # fmt: skip


if __name__ == "__main__":
    main()
