"""CPU proxy: torch ops and host µs a decode step's inputs take, rows vs built batch (stand-in
graphs whose replay does nothing, so only the input path is timed)."""
import statistics, sys, time
from types import SimpleNamespace
sys.path.insert(0, "perf")
import torch
from torch.profiler import profile, ProfilerActivity
from bench_mixed_step import runner_for
from bench_step_host import Steps, way
from m3serve.core.graphs import DecodeGraphs
from m3serve.model.slot_pages import SlotPages
from m3serve.model.tiny.default import default_model_path

runner = runner_for(str(default_model_path()), [1, 16, 64], 0, 1200, False)
runner.slot_pages = SlotPages(runner.sampler.num_slots, runner.kv.num_pages, runner.device)
graphs = DecodeGraphs(runner.model, runner.kv, runner.kv.num_pages - 1, 64, 320)
vocab = runner.model.cfg.vocab_size
for bs in graphs.sizes:
    c = graphs.bucket_inputs(bs); c.logits = torch.zeros(bs, vocab)
    c.graph = SimpleNamespace(replay=lambda: None); graphs.graphs[bs] = c
runner.graphs = graphs
for batch in (1, 16, 64):
    for name in ("rows", "batch"):
        steps = Steps(batch, 1024, runner.page_size, 300, True)
        with way(runner, name):
            runner.run(steps.first())
            times = []
            for i in range(150):
                plan = steps.next()
                t = time.perf_counter()
                seqs, _ = runner._rows(plan.seqs)
                built = runner._build(seqs, rows=True)
                graphs.run(built)
                times.append(time.perf_counter() - t)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(20):
                    seqs, _ = runner._rows(steps.next().seqs)
                    graphs.run(runner._build(seqs, rows=True))
            ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::") and e.cpu_parent is None) if False else None
            top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        print(f"B{batch:<3} {name:<6} host µs median {1e6*statistics.median(times):7.1f}  top-level aten ops/step {len(top)/20:.1f}")
