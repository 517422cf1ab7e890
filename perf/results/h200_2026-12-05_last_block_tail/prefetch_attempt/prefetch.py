"""Pulling weights into L2 ahead of the kernel that reads them (sm_90's bulk L2 prefetch).

At decode batch sizes a layer alternates between kernels that stream weights from HBM (the
projections, the experts) and kernels that barely touch it (attention over a few blocks, the
norms, the router): while the latter run, the memory system idles. A prefetch launched on a side
stream at the start of such a stretch moves the head of the next weight into L2, so the kernel
that reads it streams less from HBM. A prefetch is a hint: it changes no value, the reading
kernel does not wait for it, and a line evicted in between is read from HBM as before.

`prefetch_l2` (inside a kernel) and `l2_prefetch` (a launch of its own) issue
`cp.async.bulk.prefetch.L2` over a byte range, one instruction per CHUNK bytes: the TMA unit
fetches in the background and the issuing thread goes on at once. GPU only (inline PTX); the
interpreter has no L2 to fill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Bytes one prefetch instruction asks for (a multiple of 16, as the instruction needs).
CHUNK = 16384
# Instructions a prefetch program issues: one per lane of its warp.
_LANES = 32


@triton.jit
def prefetch_l2(ptr, start, end, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Ask L2 for bytes [start, end) after the byte pointer `ptr`: LANES instructions of up to
    CHUNK bytes from `start` (the caller steps `start` for more); whole 16-byte units only."""
    first = start + tl.arange(0, LANES).to(tl.int64) * CHUNK
    size = (tl.minimum(end - first, CHUNK) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.gt.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r",
        [ptr + first, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["nbytes"])
def l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * LANES * CHUNK
    prefetch_l2(ptr, start, nbytes, CHUNK, LANES)


def l2_prefetch(t: Tensor, nbytes: int) -> None:
    """Ask L2 for the first `nbytes` of `t` (contiguous, on a CUDA device), on the current
    stream; returns before the bytes arrive."""
    nbytes = min(nbytes, t.numel() * t.element_size())
    if nbytes < 16:
        return
    grid = (triton.cdiv(nbytes, CHUNK * _LANES),)
    raw = t.reshape(-1).view(torch.uint8)
    l2_prefetch_kernel[grid](raw, nbytes, CHUNK=CHUNK, LANES=_LANES, num_warps=1)
