"""Kernel-by-kernel device time of one MoE layer's decode (graph replay), PDL off so times add."""
import sys
sys.path.insert(0, "perf")
import torch
import m3serve.kernels.triton.attention.config as acfg
import m3serve.kernels.triton.mxfp8_linear as mxl
import m3serve.kernels.triton.router as rt
import m3serve.kernels.triton.attention.decode as dec
import m3serve.kernels.triton.nvfp4_moe as moe
off = lambda *a, **k: False
for mod in (acfg, rt, dec, moe):
    mod.pdl_supported = off
mxl._sm90 = off
from torch.profiler import ProfilerActivity, profile
from bench_decode_slice import decode_batch, random_kv
from bench_moe_layer import quantized_model, slice_config
from gpu_timing import eager_us
from m3serve.backends.hopper import HopperBackend
from m3serve.core.graphs import DecodeGraphs

cfg = slice_config(2, 4096)
device = torch.device("cuda")
model = quantized_model(cfg, HopperBackend(device))
page = cfg.page_size
for bs in (1, 8, 64):
    ctx = 4096
    pages = bs * (-(-(ctx + 1) // page)) + 1
    kv = random_kv(cfg, pages + 1, device)
    batch = decode_batch(bs, ctx, page, device)
    g = DecodeGraphs(model, kv, pages, bs, batch.page_table.shape[1])
    g.capture()
    us = eager_us(lambda: g.run(batch))
    reps = 20
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.run(batch)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name[:60], [0, 0.0])
        r[0] += 1
        r[1] += e.device_time
    total = sum(v[1] for v in rows.values())
    print(f"=== PDL off, batch {bs}: graph replay {us:.1f} us / 2 layers = {us/2:.1f} us per layer; kernels sum {total/reps/2:.1f} us per layer")
    for name, (n, t) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"  {t/reps/2:8.2f} us/layer  {n/reps/2:5.1f} calls/layer  {name}")
    del g, kv
    torch.cuda.empty_cache()
