"""Where a mixed step's host time goes (session 44): cProfile over steps of the engine's path,
and perf_counter around the pieces (replays, eager attention per layer, batch build)."""
import cProfile, io, pstats, sys, time
from collections import defaultdict
sys.path.insert(0, "perf")
import torch
from bench_mixed_step import runner_for, step
from m3serve.core import piecewise as pw

path = sys.argv[1]
runner = runner_for(path, [16, 64], 256, 1024)
page, vocab = runner.page_size, runner.model.cfg.vocab_size
sync = torch.cuda.synchronize
acc = defaultdict(float)
def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name] += time.perf_counter() - t; return r
    return wrapper
model = runner.model
for layer in model.layers:
    layer.attend = timed("attend", layer.attend)
    at = layer.self_attn
    at.backend.index_topk = timed("index_topk", at.backend.index_topk) if not hasattr(at.backend.index_topk, "__wrapped_t") else at.backend.index_topk
    setattr(at.backend.index_topk, "__wrapped_t", 1)
    at.backend.attention = timed("attention", at.backend.attention) if not hasattr(at.backend.attention, "__wrapped_t") else at.backend.attention
    setattr(at.backend.attention, "__wrapped_t", 1)
pg = runner.piecewise
pg.replays = {s: [timed("replay", r) for r in rs] for s, rs in pg.replays.items()}
pg.run = timed("piecewise.run", pg.run)
import m3serve.model.batch as mb
orig_build = mb.ForwardBatch.build
mb.ForwardBatch.build = classmethod(lambda cls, *a, **k: timed("build", orig_build)(*a, **k))
with torch.inference_mode():
    for b, c in [(16, 0), (16, 32), (16, 256), (64, 256)]:
        seqs = step(b, c, page, 1024, vocab)
        for _ in range(5):
            runner.time_step(seqs); sync()
        acc.clear()
        n = 40
        host = 0.0
        for _ in range(n):
            sync(); t = time.perf_counter(); runner.time_step(seqs); host += time.perf_counter() - t
        sync()
        print(f"== {b}+{c}: host until return {1e3*host/n:.3f} ms; " +
              ", ".join(f"{k} {1e3*v/n:.3f}" for k, v in sorted(acc.items())), flush=True)
for b, c in [(16, 0), (16, 256)]:
    seqs = step(b, c, page, 1024, vocab)
    prof = cProfile.Profile()
    with torch.inference_mode():
        for _ in range(30):
            sync(); prof.enable(); runner.time_step(seqs); prof.disable()
    sync()
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(key).print_stats(32)
        print(f"#### {b}+{c} by {key}"); print(s.getvalue()[-7000:])
