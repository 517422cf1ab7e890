"""Where a served step's device time goes (session 45): the engine's step path (graphs as served)
on the slice; per step: wall, the kernels' span and busy sum, kernels by name, and the kernels
before the first layer and after the last one."""
import sys, time
sys.path.insert(0, "perf")
import torch
from bench_mixed_step import runner_for, step, profiled

path = sys.argv[1]
runner = runner_for(path, [1, 16, 64], 256, 1024)
page, vocab = runner.page_size, runner.model.cfg.vocab_size
sync = torch.cuda.synchronize
CUDA = torch.autograd.DeviceType.CUDA
with torch.inference_mode():
    for b, c in [(1, 0), (16, 0), (64, 0), (16, 256)]:
        seqs = step(b, c, page, 1024, vocab)
        for _ in range(5):
            runner.time_step(seqs)
        sync()
        n = 30
        t = time.perf_counter()
        for _ in range(n):
            runner.time_step(seqs)
        sync()
        wall = (time.perf_counter() - t) / n * 1e3
        busy, launches, prof = profiled(runner, seqs, sync)
        ks = sorted((e for e in prof.events() if e.device_type == CUDA), key=lambda e: e.time_range.start)
        t0 = ks[0].time_range.start
        span = (max(e.time_range.end for e in ks) - t0) / 1e3
        print(f"== batch {b} chunk {c}: wall {wall:.3f} ms/step (back to back), kernel span {span:.3f} ms, busy sum {busy:.3f} ms, {launches} kernels", flush=True)
        agg = {}
        for e in ks:
            a = agg.setdefault(e.name[:100], [0, 0.0])
            a[0] += 1
            a[1] += e.time_range.elapsed_us()
        for name, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:28]:
            print(f"{us:9.1f} us {cnt:4d}x  {name}")
        print("-- first 14 and last 22 kernels: start offset us, duration us, name")
        for e in ks[:14] + [None] + ks[-22:]:
            if e is None:
                print("   ...")
                continue
            print(f"{(e.time_range.start - t0):9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:100]}")
        cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
        print(cpu[-3500:], flush=True)
