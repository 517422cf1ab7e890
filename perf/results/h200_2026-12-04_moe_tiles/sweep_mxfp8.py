"""Scratch: MXFP8 decode (MMA) tiles at M 4..64 on the model's projections (H200)."""
import sys, time
sys.path.insert(0, "perf")
import torch, triton
from bench_mxfp8_linear import SHAPES, Weight, copies_for, _calls
from gpu_timing import graph_us, read_bandwidth
from m3serve.kernels.triton.mxfp8_linear import Mxfp8Plan, plan_mxfp8

bw = read_bandwidth()
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"read bw {bw/1e12:.2f} TB/s", flush=True)

def split_for(m, n, k, bm, bn, bk, per_sm):
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = triton.cdiv(k, bk)
    target = per_sm * sms
    if tiles >= target:
        return 1
    wanted = min(triton.next_power_of_2(triton.cdiv(target, tiles)), 32)
    per = max(triton.cdiv(steps, wanted), min(2, steps))
    return triton.cdiv(steps, per)

VARIANTS = [  # name, block_n, block_k, warps, stages, per_sm
    ("n64k128w4s4p2", 64, 128, 4, 4, 2),
    ("n64k128w4s4p4", 64, 128, 4, 4, 4),
    ("n128k128w4s4p2", 128, 128, 4, 4, 2),
    ("n128k128w4s3p2", 128, 128, 4, 3, 2),
    ("n128k128w8s4p2", 128, 128, 8, 4, 2),
    ("n64k256w4s3p2", 64, 256, 4, 3, 2),
    ("n128k256w4s3p2", 128, 256, 4, 3, 2),
    ("n128k128w4s4p1", 128, 128, 4, 4, 1),
]
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qkv_index", "o_proj", "shared_gate_up", "shared_down"]
for name in shapes:
    n, k = SHAPES[name]
    w = Weight(n, k, copies_for(n * k * 33 // 32), 1)
    for m in (4, 8, 16, 32, 64):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in w.codes]
        cells = []
        served = plan_mxfp8(m, n, k, sms)
        for label, plan in [("served", served)] + [
            (v[0], Mxfp8Plan(max(16, triton.next_power_of_2(m)), v[1], v[2],
                             split_for(m, n, k, max(16, triton.next_power_of_2(m)), v[1], v[2], v[5]), v[3], v[4]))
            for v in VARIANTS] + ([("gemv", plan_mxfp8(m, n, k, sms, gemv_max_m=16))] if m <= 8 else []):
            try:
                us = graph_us(_calls(x, w, outs, plan))
            except Exception as e:  # noqa: BLE001
                cells.append(f"{label}:ERR"); continue
            cells.append(f"{label}(s{plan.split_k}):{us:.1f}/{100*w.bytes/(us*1e-6)/bw:.0f}%")
        print(f"{name} M={m}: " + "  ".join(cells), flush=True)
