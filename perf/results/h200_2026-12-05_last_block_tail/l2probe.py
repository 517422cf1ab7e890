"""Does a bulk L2 prefetch make the o_proj GEMV (M 1, 6144 x 8192 MXFP8) faster? Cold (L2
flushed), hot (just read), after a bulk prefetch of X MB, after a load prefetch of X MB; the
prefetch gets 40 µs (a sleep) to land before the GEMV is timed."""
import statistics
import torch
import triton
import triton.language as tl
from m3serve.kernels.quant import quant_mxfp8
from m3serve.kernels.triton.mxfp8_linear import mxfp8_linear
from m3serve.kernels.triton.prefetch import l2_prefetch

N, K = 6144, 8192
codes, scales = quant_mxfp8(torch.randn(N, K, device="cuda") * 0.02)
x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
sink = torch.zeros(1, dtype=torch.int32, device="cuda")


@triton.jit
def load_kernel(ptr, n, sink, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    s = tl.sum(v, 0)
    tl.store(sink, s, mask=s == 123456789)


def load_prefetch(t, nbytes):
    raw = t.view(-1).view(torch.int32)
    n = nbytes // 4
    load_kernel[(triton.cdiv(n, 4096),)](raw, n, sink, BLOCK=4096, num_warps=4)


def prefetch_rows(fn, mb):
    rows = min(N, (mb << 20) // (K + K // 32))
    fn(codes, rows * K)
    fn(scales, rows * K // 32)


def timed(pre, reps=40):
    out = []
    for _ in range(reps):
        flush.zero_()
        pre()
        torch.cuda._sleep(80000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        mxfp8_linear(x, codes, scales)
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


mxfp8_linear(x, codes, scales)
load_prefetch(codes, 1 << 20)
torch.cuda.synchronize()
print(f"cold {timed(lambda: None):6.1f} µs")
print(f"hot  {timed(lambda: mxfp8_linear(x, codes, scales)):6.1f} µs")
for mb in (12, 24, 40, 52):
    bulk = timed(lambda: prefetch_rows(l2_prefetch, mb))
    load = timed(lambda: prefetch_rows(load_prefetch, mb))
    print(f"{mb:2d} MB: bulk prefetch {bulk:6.1f} µs, load prefetch {load:6.1f} µs", flush=True)
