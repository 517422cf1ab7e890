"""Launch the NVFP4 MoE at T=1, T=32 and a 2048-token prefill a few times each (for ncu)."""
import sys
sys.path.insert(0, "perf")
import torch
import bench_nvfp4_moe as B
ex = B.random_experts()
for t in [int(a) for a in sys.argv[1:]]:
    step = B.steps(t, 1, seed=t)[0]
    call = B.moe_call(ex, step)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print("done", t, flush=True)
