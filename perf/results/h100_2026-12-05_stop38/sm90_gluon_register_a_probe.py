"""Stop 38, off-line (Triton 3.6 Gluon, sm_90, no GPU): a wgmma with its A operand decoded in
registers, issued asynchronously, the next tile decoded before the wait (decode-ahead). The
SASS still waits right after the wgmma group (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) and decodes the
next tile after it: ptxas protects the in-flight A registers by waiting, not by allocating
others (with `wait(1)` instead of decode-ahead it serialized every HGMMA). So a register A
operand does not overlap the decode with the MMA; see `sm90_gluon_smem_a_probe.py`.

    /tmp/t36/bin/python perf/results/h100_2026-12-05_stop38/sm90_gluon_register_a_probe.py
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
def _decode(w_ptr, rows, cols, k, K):
    codes = gl.load(w_ptr + rows[:, None] * K + (k + cols)[None, :])
    return (codes.to(gl.float32) * 0.5).to(gl.bfloat16)


@gluon.jit
def probe(w_ptr, x_ptr, out_ptr, K, OUTSTANDING: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    b_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, a_layout))
    xr = gl.arange(0, BK, layout=gl.SliceLayout(1, x_load))
    xc = gl.arange(0, BM, layout=gl.SliceLayout(0, x_load))
    bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BM], b_smem)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    a = _decode(w_ptr, rows, cols, 0, K)
    for i in range(0, K // BK):
        k = i * BK
        xt = gl.load(x_ptr + (k + xr)[:, None] * BM + xc[None, :])
        buf = bufs.index(i % 2)
        buf.store(xt)
        fence_async_shared()
        acc = warpgroup_mma(a, buf, acc, is_async=True)
        a_next = _decode(w_ptr, rows, cols, (k + BK) % K, K)
        acc, _, a = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=[acc, a, a_next])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    orow = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + orow[:, None] * BM + ocol[None, :], acc)


sig = {"w_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*fp32", "K": "i32", "OUTSTANDING": "constexpr"}
for outstanding in (0,):
    src = GluonASTSource(
        probe,
        sig,
        constexprs={"OUTSTANDING": outstanding},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(4)},
    )
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.cubin"
        p.write_bytes(c.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(p)], capture_output=True, text=True).stdout
    print(f"== decode ahead, wait({outstanding})")
    for line in sass.splitlines():
        if re.search(r"HGMMA|WARPGROUP|DEPBAR|BRA|BAR\.SYNC|LDG", line):
            print("  ", line.strip()[:100])
