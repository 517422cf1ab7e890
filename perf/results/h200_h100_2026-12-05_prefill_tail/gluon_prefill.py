"""Stop 39, call 2 (H100: exact, 292.4 TFLOP/s at 64 pairs an expert against the served
kernel's 350.9: set aside, see README.md). The W4A16 grouped product at prefill shapes in
Gluon, the decoded weight tile's MMA overlapped with the next tile's decode, the loads in a
cp.async ring.

out[e, n, m] = sum_k W_e[n, k] x_e[m, k]: W NVFP4 row-tiled as the served kernels hold it
(`m3serve.kernels.nvfp4_tiles`: codes [E, N/32, K/128, 32, 64] bytes, scales [E, N/32, K/128,
32, 8] e4m3; no global scale), x bf16 [E, M, K] with each 128-wide tile in split order (its
even elements, then its odd ones). A program: BN = 128 weight rows (two warpgroups) x BM tokens
of one expert.

Per K tile i (STAGES-deep ring of codes, scales and x, filled by cp.async):
  wait for tile i's copies; barrier
  decode tile i to registers           (wgmma i-1 still running)
  wait for this warpgroup's wgmma i-1  (its rows of A are then free: each warpgroup writes and
                                        reads only its own 64 rows)
  store the decoded tile to A; fence; barrier (every wgmma i-1 done: ring slot i-1 free)
  wgmma i (async)
  cp.async tile i + STAGES - 1 into slot i - 1

    PYTHONPATH=$PWD /tmp/t36/bin/python perf/results/h200_h100_2026-12-05_prefill_tail/gluon_prefill.py    # sm_90 compile, SASS stats
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
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.append("/work/venv/lib/python3.11/site-packages")  # the dev box: m3serve's deps
from m3serve.kernels.triton.nvfp4_moe.decode import E2M1_PTX

BN = gl.constexpr(128)  # weight rows a program: two warpgroups of 64
BK = gl.constexpr(128)  # a weight tile's K width
HALF = gl.constexpr(64)  # bytes of a tile row
GROUPS = gl.constexpr(8)  # scales of a tile row
SCALE_BOOST = gl.constexpr(2.0**119)
ACC_SCALE = gl.constexpr(2.0**7)

# Warp w holds rows 16w..16w+15, so warpgroup g (warps 4g..4g+3) decodes and stores exactly the
# 64 rows its wgmma reads.
CODE_L = gl.constexpr(gl.BlockedLayout([2, 16], [8, 4], [8, 1], [1, 0]))
SCALE_CP = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [8, 1], [1, 0]))
SCALE_L3 = gl.constexpr(gl.BlockedLayout([2, 2, 8], [8, 4, 1], [8, 1, 1], [2, 1, 0]))
RAW_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
OP_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

# The served decode (`nvfp4_moe.decode.E2M1_PTX`) with one scale register for the 4 bytes: a
# pack of 4 bytes never straddles a group of 8, so $5 (bf16 scale twice) serves all of them.
E2M1_ONE_SCALE = gl.constexpr(E2M1_PTX.value.replace("$6", "$5"))


@gluon.jit
def _issue_loads(w_base, s_base, x_base, codes_smem, scales_smem, x_smem, t, K, M,
                 BM: gl.constexpr, X_CP: gl.constexpr):  # fmt: skip
    """cp.async of tile t's codes [BN, 64], scales [BN, 8] and activations [BM, BK]."""
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, CODE_L))
    c = gl.arange(0, HALF, layout=gl.SliceLayout(0, CODE_L))
    rows = (r // 32) * (32 * (K // 2)) + (r % 32) * HALF + t * (32 * HALF)
    cp.async_copy_global_to_shared(codes_smem, w_base + rows[:, None] + c[None, :])
    sr = gl.arange(0, BN, layout=gl.SliceLayout(1, SCALE_CP))
    sc = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, SCALE_CP))
    srows = (sr // 32) * (32 * (K // 16)) + (sr % 32) * GROUPS + t * (32 * GROUPS)
    cp.async_copy_global_to_shared(scales_smem, s_base + srows[:, None] + sc[None, :])
    xm = gl.arange(0, BM, layout=gl.SliceLayout(1, X_CP))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(0, X_CP))
    ptrs = x_base + xm[:, None] * K + (t * BK + xk)[None, :]
    cp.async_copy_global_to_shared(x_smem, ptrs, mask=(xm < M)[:, None])
    cp.commit_group()


@gluon.jit
def _scale_words(scales_smem):
    """Each code byte's scale as a 32-bit word holding bf16(scale * 2^119) twice, [BN, 64] in
    CODE_L (the broadcast from the 8 groups to the 64 bytes is register reuse)."""
    s = scales_smem.load(gl.SliceLayout(2, SCALE_L3))
    bits = (s.to(gl.float32) * SCALE_BOOST).to(gl.bfloat16).to(gl.int16, bitcast=True)
    word = bits.to(gl.int32) & 0xFFFF
    word = word | (word << 16)
    rep = gl.full([BN, GROUPS, 8], 0, gl.int32, SCALE_L3)
    words = gl.expand_dims(word, 2) + rep
    return gl.convert_layout(gl.reshape(words, [BN, HALF]), CODE_L)


@gluon.jit
def _decode(codes, words):
    """(even, odd) elements [BN, 64] bf16: e2m1 * scale * 2^-7."""
    return gl.inline_asm_elementwise(
        asm=E2M1_ONE_SCALE,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[codes, words],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def w4a16_grouped_kernel(w_ptr, s_ptr, x_ptr, out_ptr, N, K, M,
                         BM: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    gl.assume(K >= STAGES * BK)
    X_CP: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 16]
    )
    e = gl.program_id(1).to(gl.int64)
    w_base = w_ptr + e * (N * (K // 2)) + gl.program_id(0) * (BN * (K // 2))
    s_base = s_ptr + e * (N * (K // 16)) + gl.program_id(0) * (BN * (K // 16))
    x_base = x_ptr + e * (M * K)
    codes_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, HALF], RAW_SMEM)
    scales_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, GROUPS], RAW_SMEM)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], OP_SMEM)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BK], OP_SMEM)
    tiles = K // BK
    for t in gl.static_range(STAGES - 1):
        _issue_loads(w_base, s_base, x_base, codes_ring.index(t), scales_ring.index(t),
                     x_ring.index(t), t, K, M, BM, X_CP)  # fmt: skip
    acc = gl.zeros([BN, BM], gl.float32, layout=MMA)
    for i in range(0, tiles):
        slot = i % STAGES
        cp.wait_group(STAGES - 2)
        gl.thread_barrier()
        codes = codes_ring.index(slot).load(CODE_L)
        lo, hi = _decode(codes, _scale_words(scales_ring.index(slot)))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        a_smem.slice(0, HALF, dim=1).store(lo)
        a_smem.slice(HALF, HALF, dim=1).store(hi)
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(a_smem, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # a tensor again, still running
        ahead = i + STAGES - 1
        nxt = ahead % STAGES
        _issue_loads(w_base, s_base, x_base, codes_ring.index(nxt), scales_ring.index(nxt),
                     x_ring.index(nxt), ahead % tiles, K, M, BM, X_CP)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    cp.wait_group(0)
    orow = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    ptrs = out_ptr + e * (N * BM) + orow[:, None] * BM + ocol[None, :]
    gl.store(ptrs, acc * ACC_SCALE, mask=(ocol < M)[None, :])


def compile_sm90(bm: int, stages: int):
    signature = {"w_ptr": "*u8", "s_ptr": "*fp8e4nv", "x_ptr": "*bf16", "out_ptr": "*fp32",
                 "N": "i32", "K": "i32", "M": "i32", "BM": "constexpr", "STAGES": "constexpr"}  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    source = GluonASTSource(
        w4a16_grouped_kernel, signature, constexprs={"BM": bm, "STAGES": stages}, attrs=aligned
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


def main() -> None:
    bm = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    stages = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    compiled = compile_sm90(bm, stages)
    print(f"BM {bm} stages {stages}: shared {compiled.metadata.shared} bytes, "
          f"regs {compiled.n_regs if hasattr(compiled, 'n_regs') else '?'}")  # fmt: skip
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run(
            [str(tool), "-sass", str(path)], capture_output=True, text=True
        ).stdout
        res = subprocess.run(
            [str(tool), "-res-usage", str(path)], capture_output=True, text=True
        ).stdout
    print(res.strip().splitlines()[-1][:200])
    ops: dict[str, int] = {}
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            op = m.group(2).split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        if re.search(r"HGMMA|DEPBAR|BAR\.SYNC|LDGDEPBAR|BRA", line):
            print("  ", line.strip()[:110])
    print(sorted(ops.items(), key=lambda kv: -kv[1])[:25])


if __name__ == "__main__":
    main()
