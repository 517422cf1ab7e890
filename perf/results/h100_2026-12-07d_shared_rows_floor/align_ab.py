"""Same-process A/B of the align kernels' CHUNK in the MoE layer at batch 64 (one model, one
KV cache, one batch: the same routing for both)."""

import sys

import torch

sys.path.insert(0, "perf")
import bench_moe_layer_parts as parts  # noqa: E402
from bench_decode_slice import decode_batch, random_kv  # noqa: E402
from bench_moe_layer import quantized_model, slice_config  # noqa: E402

from m3serve.backends.hopper import HopperBackend  # noqa: E402
from m3serve.kernels.triton.nvfp4_moe import align  # noqa: E402

dev = torch.device("cuda")
torch.manual_seed(0)
cfg = slice_config(4, 4096)
model = quantized_model(cfg, HopperBackend(dev))
for bs in (64, 128):
    pages = bs * 33 + 1
    kv = random_kv(cfg, pages + 1, dev)
    batch = decode_batch(bs, 4096, cfg.page_size, dev)
    for chunk in (128, 64, 128, 64, 128, 64):
        align.CHUNK = chunk
        us, rest = parts.marginal_us(model, batch, kv, 4)
        print(f"batch {bs} CHUNK {chunk:3d}: {us:7.1f} µs a layer (rest {rest:6.1f})", flush=True)
    del kv
    torch.cuda.empty_cache()
