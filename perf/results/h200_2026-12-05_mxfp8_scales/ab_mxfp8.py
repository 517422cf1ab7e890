"""Same-machine A/B of the MXFP8 MMA kernel: the 5aa2d62 kernel (old: byte scales, no prefetch)
against this tree's (new: scale words where the plan says, the prefill tiles' scale prefetch),
and this tree's with the scale load flipped (bytes <-> words) on K-128 tiles."""
import dataclasses, importlib.util, sys, json
sys.path.insert(0, "perf")
import torch
from bench_mxfp8_linear import SHAPES, Weight, copies_for
from gpu_timing import graph_us, read_bandwidth
import m3serve.kernels.triton.mxfp8_linear as lin
from m3serve.kernels.triton.mxfp8_linear import mxfp8_linear, plan_mxfp8

spec = importlib.util.spec_from_file_location("mxfp8_kernels_old", ".scratch/mxfp8_kernels_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
new_kernel = lin.mxfp8_mma_kernel

class DropWords:
    def __init__(self, k): self.k = k
    def __getitem__(self, grid):
        launch = self.k[grid]
        def call(*a, **kw):
            kw.pop("SCALE_WORDS", None)
            return launch(*a, **kw)
        return call

bw = read_bandwidth()
print(f"read bandwidth {bw / 1e12:.2f} TB/s")
sms = torch.cuda.get_device_properties(0).multi_processor_count
rows = []
for name in ["qkv_index", "o_proj", "shared_gate_up", "shared_down"]:
    n, k = SHAPES[name]
    w = Weight(n, k, copies_for(n * k * 33 // 32), 1)
    for m in [8, 24, 32, 64, 96, 128]:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in w.codes]
        plan = plan_mxfp8(m, n, k, sms)
        def calls(p):
            return [lambda i=i: mxfp8_linear(x, w.codes[i], w.scales[i], out=outs[i], plan=p) for i in range(len(outs))]
        res = {}
        lin.mxfp8_mma_kernel = DropWords(old.mxfp8_mma_kernel)
        oldp = dataclasses.replace(plan, scale_words=False)
        res["old"] = graph_us(calls(oldp)); ref = outs[0].clone()
        lin.mxfp8_mma_kernel = new_kernel
        res["new"] = graph_us(calls(plan)); same = torch.equal(ref, outs[0])
        if plan.block_k == 128:
            res["flip"] = graph_us(calls(dataclasses.replace(plan, scale_words=not plan.scale_words)))
        row = {"shape": name, "m": m, "block_m": plan.block_m, "block_n": plan.block_n, "block_k": plan.block_k,
               "split": plan.split_k, "words": plan.scale_words, "same_output": same, **{f"{k}_us": v for k, v in res.items()}}
        rows.append(row)
        frac = lambda us: 100 * w.bytes / (us * 1e-6) / bw
        flip = f"  flip({'bytes' if plan.scale_words else 'words'}) {res['flip']:7.2f} ({frac(res['flip']):4.1f}%)" if "flip" in res else ""
        print(f"{name:15s} M {m:3d} tile {plan.block_m}x{plan.block_n}x{plan.block_k} split {plan.split_k} words {int(plan.scale_words)}: "
              f"old {res['old']:7.2f} ({frac(res['old']):4.1f}%)  new {res['new']:7.2f} ({frac(res['new']):4.1f}%)  new/old {res['new']/res['old']:.3f}{flip}  same={same}", flush=True)
    del w
    torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ab.json", "w"), indent=1)
