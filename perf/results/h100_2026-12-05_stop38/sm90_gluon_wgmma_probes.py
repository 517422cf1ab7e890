"""Stop 38, off-line (Triton 3.6 Gluon, sm_90, no GPU): can the MMA of one weight tile overlap
the decode of the next? Two probes, each printing its wgmma instructions and waits from the SASS.
The "decode" is a stand-in (bytes * 0.5); timing a real W4A16 kernel needs the GPU.

- `register_a`: the decoded tile as the register A operand of an asynchronous wgmma, the next
  tile decoded before the wait (decode-ahead). The SASS still waits to 0 right after the wgmma
  group and decodes afterwards (with `wait(1)` instead, ptxas serialized every HGMMA): ptxas
  keeps an in-flight A operand's registers safe by waiting.
- `smem_a`: the decoded tile stored to a double-buffered shared buffer, both operands read from
  shared memory. The SASS keeps one group in flight (`WARPGROUP.DEPBAR.LE gsb0, 0x1`): tile k's
  MMA overlaps tile k+1's decode, which the served Triton kernel (register operand, a wait to 0
  after every group) cannot do.

    /tmp/t36/bin/python perf/results/h100_2026-12-05_stop38/sm90_gluon_wgmma_probes.py
"""

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BN = gl.constexpr(64)  # weight rows (the MMA's M side)
BM = gl.constexpr(16)  # tokens
BK = gl.constexpr(64)
MMA = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
)


X_LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
B_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))


@gluon.jit
def _x_tile(x_ptr, k):
    """The activations' [BK, BM] tile at K offset k (x stored [K, BM])."""
    xr = gl.arange(0, BK, layout=gl.SliceLayout(1, X_LOAD))
    xc = gl.arange(0, BM, layout=gl.SliceLayout(0, X_LOAD))
    return gl.load(x_ptr + (k + xr)[:, None] * BM + xc[None, :])


@gluon.jit
def _decode(w_ptr, rows, cols, k, K):
    codes = gl.load(w_ptr + rows[:, None] * K + (k + cols)[None, :])
    return (codes.to(gl.float32) * 0.5).to(gl.bfloat16)


@gluon.jit
def _store_acc(out_ptr, acc, mma: gl.constexpr):
    orow = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + orow[:, None] * BM + ocol[None, :], acc)


@gluon.jit
def register_a(w_ptr, x_ptr, out_ptr, K):
    mma: gl.constexpr = MMA
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, a_layout))
    bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BM], B_SMEM)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    a = _decode(w_ptr, rows, cols, 0, K)
    for i in range(0, K // BK):
        k = i * BK
        buf = bufs.index(i % 2)
        buf.store(_x_tile(x_ptr, k))
        fence_async_shared()
        acc = warpgroup_mma(a, buf, acc, is_async=True)
        a_next = _decode(w_ptr, rows, cols, (k + BK) % K, K)
        acc, _, a = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a, a_next])
    _store_acc(out_ptr, acc, mma)


@gluon.jit
def smem_a(w_ptr, x_ptr, out_ptr, K):
    mma: gl.constexpr = MMA
    w_load: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    a_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, w_load))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, w_load))
    abufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], a_smem)
    bbufs = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BM], B_SMEM)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    for i in range(0, K // BK):
        k = i * BK
        abuf = abufs.index(i % 2)
        bbuf = bbufs.index(i % 2)
        abuf.store(_decode(w_ptr, rows, cols, k, K))
        bbuf.store(_x_tile(x_ptr, k))
        fence_async_shared()
        acc = warpgroup_mma(abuf, bbuf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    _store_acc(out_ptr, acc, mma)


def sass(kernel) -> str:
    signature = {"w_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*fp32", "K": "i32"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = GluonASTSource(kernel, signature, constexprs={}, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        command = [str(tool), "-sass", str(path)]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout


if __name__ == "__main__":
    for kernel in (register_a, smem_a):
        print(f"== {kernel.__name__}")
        for line in sass(kernel).splitlines():
            if re.search(r"HGMMA|WARPGROUP|BAR\.SYNC", line):
                print("  ", line.strip()[:100])
