"""CPU proxy: cProfile of a served decode step's host path (prepare + run, launched ahead) with
stand-in graphs that draw (replay does nothing; the draw is a stub), rows vs batch."""
import cProfile, pstats, statistics, sys, time, io
from types import SimpleNamespace
sys.path.insert(0, "perf")
import torch
from bench_mixed_step import runner_for
from bench_step_host import Steps, way
from m3serve.core.graphs import DecodeGraphs, GraphDraw
from m3serve.core.sampler import DRAW_KNOBS
from m3serve.model.tiny.default import default_model_path

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16
runner = runner_for(str(default_model_path()), [B], 0, 1400, False)
def stub_sample(logits, *knobs, out):
    return out
draw = GraphDraw(stub_sample, DRAW_KNOBS, runner.last_tokens)
graphs = DecodeGraphs(runner.model, runner.kv, runner.kv.num_pages - 1, 64, 360, draw)
vocab = runner.model.cfg.vocab_size
for bs in graphs.sizes:
    c = graphs.bucket_inputs(bs); c.logits = torch.zeros(bs, vocab)
    c.graph = SimpleNamespace(replay=lambda: None); graphs.graphs[bs] = c
runner.graphs = graphs
runner.sampler._device_draw = stub_sample
runner.launch_ahead = True
import m3serve.core.step_runner as sr
sr._device_done = lambda device: (lambda: False)
for name in ("rows", "batch"):
    steps = Steps(B, 1024, runner.page_size, 350, False)
    with way(runner, name):
        runner.run(steps.first())
        for _ in range(20):
            p = steps.next(); runner.prepare(p); runner.run(p)
        times = []
        prof = cProfile.Profile()
        for i in range(150):
            p = steps.next()
            t = time.perf_counter()
            if i >= 100: prof.enable()
            runner.prepare(p)
            if i >= 100: prof.disable()
            times.append(time.perf_counter() - t)
            runner.run(p)
        print(f"B{B} {name}: prepare median {1e6*statistics.median(times):.1f} µs")
        if name == "rows":
            s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:4000])
