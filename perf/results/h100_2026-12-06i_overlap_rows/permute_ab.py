"""permute_k_kernel as it was before stop 51 (contiguous loads, scattered stores) against the
served one (gathered loads, contiguous stores) and a plain copy, alone under CUDA-graph replay,
at the token counts of decode and mixed steps; the two must agree bit for bit. Run from the repo
root with perf/ on sys.path."""

import sys

import torch
import triton
import triton.language as tl
from gpu_timing import graph_us

from m3serve.kernels.nvfp4_tiles import tile_k
from m3serve.kernels.triton.nvfp4_moe.decode import mma_k_position, mma_k_source
from m3serve.kernels.triton.nvfp4_moe.kernels import permute_k_kernel


@triton.jit(do_not_specialize=["tokens"])
def permute_scatter_kernel(
    x_ptr, stride_xt, out_ptr, stride_ot, tokens, BLOCK_T: tl.constexpr, TILE_K: tl.constexpr
):
    """The kernel before stop 51: contiguous loads, scattered stores."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)
    ok = (t < tokens)[:, None]
    t64 = t.to(tl.int64)[:, None]
    values = tl.load(x_ptr + t64 * stride_xt + j[None, :], mask=ok)
    tl.store(out_ptr + t64 * stride_ot + mma_k_position(j, TILE_K)[None, :], values, mask=ok)


@triton.jit
def position_kernel(out_ptr, TILE_K: tl.constexpr):
    j = tl.arange(0, TILE_K)
    tl.store(out_ptr + j, mma_k_source(mma_k_position(j, TILE_K), TILE_K))


hidden = 6144
tk = tile_k(hidden)
for t in (16, 32, 64, 128):
    got = torch.empty(t, dtype=torch.int32, device="cuda")
    position_kernel[(1,)](got, TILE_K=t)
    assert torch.equal(got.cpu(), torch.arange(t, dtype=torch.int32)), (t, got)
for tokens in [int(v) for v in sys.argv[1].split(",")]:
    xs = [torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(8)]
    outs = [torch.empty_like(x) for x in xs]
    outs2 = [torch.empty_like(x) for x in xs]

    def scatter(i, block_t=16):
        return lambda: permute_scatter_kernel[(triton.cdiv(tokens, block_t), hidden // tk)](
            xs[i], hidden, outs[i], hidden, tokens, BLOCK_T=block_t, TILE_K=tk, num_warps=4)

    def gather(i, block_t=16):
        return lambda: permute_k_kernel[(triton.cdiv(tokens, block_t), hidden // tk)](
            xs[i], hidden, outs2[i], hidden, tokens, BLOCK_T=block_t, TILE_K=tk, num_warps=4)

    scatter(0)()
    gather(0)()
    assert torch.equal(outs[0], outs2[0])
    s = graph_us([scatter(i) for i in range(8)])
    g = graph_us([gather(i) for i in range(8)])
    c = graph_us([lambda i=i: outs2[i].copy_(xs[i]) for i in range(8)])
    print(f"tokens {tokens:5d}: scatter {s:7.2f} µs  gather {g:7.2f} µs  copy {c:7.2f} µs")
