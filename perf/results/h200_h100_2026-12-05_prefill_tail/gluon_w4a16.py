"""Stop 38's draft, run in stop 39 (call 1, H100: exact; 55.7 us for 84.9 MB at one token, 50.1 %
of the read bandwidth, against the served MoE's 71.9 %: set aside). The W4A16 tile product
in Gluon with the decoded weights through double-buffered shared memory and one wgmma group kept
in flight
(`perf/results/h100_2026-12-05_stop38/sm90_gluon_wgmma_probes.py`'s `smem_a` structure).

out[n, m] = sum_k W[n, k] * x[m, k] * 2^-7 ... times 2^7: W NVFP4 row-tiled as the served
kernels hold it (`m3serve.kernels.nvfp4_tiles`: rows in groups of 32, each group's K in
contiguous 128-wide tiles; codes [N/32, K/128, 32, 64] bytes, scales [N/32, K/128, 32, 8] e4m3),
no global scale; x bf16 [M, K] in *split* order per 128-wide tile: the tile's even elements,
then its odd ones (what `permute_k_kernel` would write instead of the MMA K order), M <= BM.

State (sm_90 compile, Triton 3.6 + ptxas): one wgmma group in flight (`DEPBAR.LE gsb0, 0x1`),
40 KB shared, 85 registers; the K loop is 357 instructions per tile per thread (32 weight bytes:
11.2 per byte; PRMT 86 of them, the same whether the scales are broadcast by joins or by an
OR with zero: find where they come from in the SASS first). Without the register
prefetch and with the scales loaded per byte from repeated addresses it was 277 (8.7 per byte;
the served tile ~8). `gl.assume(K >= BK)` matters: without it the zero-trip path's accumulator
moves made ptxas serialize every wgmma (C7515).

Next session: exactness on the GPU against `dequant_nvfp4` + fp32 matmul, then time it against
`nvfp4_mma` at T = 1..32 (one expert's gate_up rows) in the same call; then the scale path
(convert per group inside the PTX, one bf16x2 per 8 bytes) and asynchronous copies for the
loads (`gluon.language.nvidia.ampere.async_copy`) instead of the register prefetch.

    PYTHONPATH=$PWD /tmp/t36/bin/python perf/results/h200_h100_2026-12-05_prefill_tail/gluon_w4a16.py    # compile for sm_90, SASS waits
"""

import re
import subprocess
import sys
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

sys.path.append("/work/venv/lib/python3.11/site-packages")
from m3serve.kernels.triton.nvfp4_moe.decode import E2M1_PTX

BN = gl.constexpr(64)  # weight rows a program (the MMA's M side: one warpgroup)
BM = gl.constexpr(16)  # tokens (the MMA's N side)
BK = gl.constexpr(128)  # a weight tile's K width
HALF = gl.constexpr(64)  # bytes of a tile row
GROUPS = gl.constexpr(8)  # scales of a tile row
SCALE_BOOST = gl.constexpr(2.0**119)
ACC_SCALE = gl.constexpr(2.0**7)

W_LOAD = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
S_BYTES = gl.constexpr(gl.BlockedLayout([1, 2, 8], [8, 4, 1], [4, 1, 1], [2, 1, 0]))
X_LOAD = gl.constexpr(gl.BlockedLayout([8, 1], [16, 2], [1, 4], [0, 1]))
MMA = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
)
A_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
B_SMEM = gl.constexpr(
    gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2, transposed=True)
)


@gluon.jit
def _load_tile(w_ptr, s_ptr, x_ptr, rows, k, K, M):
    """The weight tile at K offset k (codes [BN, HALF] and each byte's scale, as bf16 times
    2^119 for the PTX decode) and the activations' [BK, BM] tile."""
    kb = gl.arange(0, HALF, layout=gl.SliceLayout(0, W_LOAD))
    group = rows // 32
    lane = rows % 32
    codes = gl.load(w_ptr + (group * (32 * (K // 2)) + lane * HALF + k * 16)[:, None] + kb[None, :])
    # Each scale covers 8 bytes: converted once per group, then broadcast to the bytes by an
    # OR with zero on its bits (which folds away: a register broadcast, no instruction).
    srow = gl.program_id(0) * BN + gl.arange(
        0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, S_BYTES))
    )
    sg = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, S_BYTES)))
    s_off = ((srow // 32) * (32 * (K // 16)) + (srow % 32) * GROUPS + k * 2)[:, None] + sg[None, :]
    s = (gl.load(s_ptr + s_off).to(gl.float32) * SCALE_BOOST).to(gl.bfloat16)
    bits = gl.expand_dims(s.to(gl.int16, bitcast=True), 2)
    rep = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, S_BYTES)))
    zero = gl.expand_dims(gl.expand_dims((rep * 0).to(gl.int16), 0), 1)
    s = (bits | zero).to(gl.bfloat16, bitcast=True)
    s = gl.convert_layout(gl.reshape(s, [BN, HALF]), W_LOAD)
    xk = gl.arange(0, BK, layout=gl.SliceLayout(1, X_LOAD))
    xm = gl.arange(0, BM, layout=gl.SliceLayout(0, X_LOAD))
    x = gl.load(x_ptr + xm[None, :] * K + (k + xk)[:, None], mask=(xm < M)[None, :], other=0.0)
    return codes, s, x


@gluon.jit
def _decode(codes, s):
    """(even, odd) elements [BN, HALF] bf16, e2m1 * scale * 2^-7 (the served PTX decode)."""
    return gl.inline_asm_elementwise(
        asm=E2M1_PTX,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[codes, s],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def w4a16_tile_kernel(w_ptr, s_ptr, x_ptr, out_ptr, K, M):
    # No zero-trip path to the final wait: with one, the zeroed accumulator's moves sit inside
    # the wgmma pipeline and ptxas serializes every wgmma (C7515).
    gl.assume(K >= BK)
    rows = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, W_LOAD))
    abufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], A_SMEM)
    bbufs = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BM], B_SMEM)
    acc = gl.zeros([BN, BM], gl.float32, layout=MMA)
    tiles = K // BK
    # Register prefetch: tile i+1's loads are issued before tile i is decoded and multiplied.
    codes, s, x = _load_tile(w_ptr, s_ptr, x_ptr, rows, 0, K, M)
    for i in range(0, tiles):
        ahead = (i + 1) % tiles * BK  # the last step reloads tile 0, unused
        codes_next, s_next, x_next = _load_tile(w_ptr, s_ptr, x_ptr, rows, ahead, K, M)
        lo, hi = _decode(codes, s)
        abuf = abufs.index(i % 2)
        abuf.slice(0, HALF, dim=1).store(lo)
        abuf.slice(HALF, HALF, dim=1).store(hi)
        bbuf = bbufs.index(i % 2)
        bbuf.store(x)
        fence_async_shared()
        acc = warpgroup_mma(abuf, bbuf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        codes, s, x = codes_next, s_next, x_next
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    orow = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    gl.store(
        out_ptr + orow[:, None] * BM + ocol[None, :], acc * ACC_SCALE, mask=(ocol < M)[None, :]
    )


def main() -> None:
    signature = {"w_ptr": "*u8", "s_ptr": "*fp8e4nv", "x_ptr": "*bf16", "out_ptr": "*fp32",
                 "K": "i32", "M": "i32"}  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    source = GluonASTSource(w4a16_tile_kernel, signature, constexprs={}, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(f"shared {compiled.metadata.shared} bytes")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run(
            [str(tool), "-sass", str(path)], capture_output=True, text=True
        ).stdout
    for line in sass.splitlines():
        if re.search(r"HGMMA|DEPBAR|BAR\.SYNC|BRA", line):
            print("  ", line.strip()[:100])


if __name__ == "__main__":
    main()
