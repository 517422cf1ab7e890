"""The served MXFP8 plan of the four attention/shared projections at each M (CUDA-graph replay,
weights rotated past L2), and cuBLAS on the bf16 copy: run once per tree (PYTHONPATH) to compare
kernel variants on one machine. Usage: python rows_ab.py TAG M,M,..."""

import sys

import torch
from bench_mxfp8_linear import _calls, operands, sweep_weight
from gpu_timing import graph_us

from m3serve.kernels.triton.mxfp8_linear import mxfp8_linear, plan_mxfp8

tag, ms = sys.argv[1], [int(m) for m in sys.argv[2].split(",")]
names = ("qkv_index", "o_proj", "shared_gate_up", "shared_down")
served = {m: 0.0 for m in ms}
copy = {m: 0.0 for m in ms}
for name in names:
    n, k, weight, sms = sweep_weight(name, bf16_reads=True)
    for m in ms:
        x, outs = operands(m, weight)
        plan = plan_mxfp8(m, n, k, sms)
        ref = x.float() @ weight.dense[0].float().t()
        got = mxfp8_linear(x, weight.codes[0], weight.scales[0], plan=plan).float()
        err = float((got - ref).norm() / ref.norm())
        assert err < 1e-2, (name, m, err)
        us = graph_us(_calls(x, weight, outs, plan))
        served[m] += us
        copy[m] += graph_us(_calls(x, weight, outs, plan_mxfp8(m, n, k, sms, dequant_min_m=0),
                                   weight.dense))
        print(f"{tag} {name:>15} M {m:4d} served {us:7.1f} µs (bm {plan.block_m}, split "
              f"{plan.split_k}, rel err {err:.1e})")
    del weight
    torch.cuda.empty_cache()
for m in ms:
    print(f"{tag} four projections M {m:4d}: served {served[m]:7.1f} µs  bf16 copy {copy[m]:7.1f}")
