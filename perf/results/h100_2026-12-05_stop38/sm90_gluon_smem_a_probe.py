"""Stop 38, off-line (Triton 3.6 Gluon, sm_90, no GPU): decoded weights through shared memory,
both wgmma operands from shared memory, double-buffered, so a wgmma group stays in flight
(`wait(1)`) while the next tile is decoded and stored. The SASS has `WARPGROUP.DEPBAR.LE gsb0,
0x1` after each group: the MMA of tile k overlaps the decode of tile k+1, what the served
Triton kernel (register operand, a wait to 0 after every group) cannot do. The probe's "decode"
is a stand-in (bytes * 0.5); timing a real W4A16 kernel of this shape needs the GPU.

    /tmp/t36/bin/python perf/results/h100_2026-12-05_stop38/sm90_gluon_smem_a_probe.py
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

BN = gl.constexpr(64)
BM = gl.constexpr(16)
BK = gl.constexpr(64)


@gluon.jit
def probe(w_ptr, x_ptr, out_ptr, K):
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
    )
    w_load: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    x_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    a_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    b_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, w_load))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, w_load))
    xr = gl.arange(0, BK, layout=gl.SliceLayout(1, x_load))
    xc = gl.arange(0, BM, layout=gl.SliceLayout(0, x_load))
    abufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], a_smem)
    bbufs = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BM], b_smem)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    for i in range(0, K // BK):
        k = i * BK
        codes = gl.load(w_ptr + rows[:, None] * K + (k + cols)[None, :])
        a = (codes.to(gl.float32) * 0.5).to(gl.bfloat16)
        xt = gl.load(x_ptr + (k + xr)[:, None] * BM + xc[None, :])
        abuf = abufs.index(i % 2)
        bbuf = bbufs.index(i % 2)
        abuf.store(a)
        bbuf.store(xt)
        fence_async_shared()
        acc = warpgroup_mma(abuf, bbuf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    orow = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + orow[:, None] * BM + ocol[None, :], acc)


sig = {"w_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*fp32", "K": "i32"}
src = GluonASTSource(
    probe, sig, constexprs={}, attrs={(i,): [["tt.divisibility", 16]] for i in range(4)}
)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
with tempfile.TemporaryDirectory() as tmp:
    p = Path(tmp) / "k.cubin"
    p.write_bytes(c.asm["cubin"])
    sass = subprocess.run([str(tool), "-sass", str(p)], capture_output=True, text=True).stdout
for line in sass.splitlines():
    if re.search(r"HGMMA|WARPGROUP|DEPBAR|BRA|BAR\.SYNC", line):
        print("  ", line.strip()[:100])
