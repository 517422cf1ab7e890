"""perf/bench_mixed_step.py with the mixed-step attention split on from N decode rows (argv[1])."""
import dataclasses
import runpy
import sys

import m3serve.kernels.triton.attention as attention

rows = int(sys.argv[1])
attention.DEFAULT_CONFIG = dataclasses.replace(attention.DEFAULT_CONFIG, mixed_decode_min_rows=rows)
sys.argv = ["perf/bench_mixed_step.py", *sys.argv[2:]]
sys.path.insert(0, "perf")
runpy.run_path("perf/bench_mixed_step.py", run_name="__main__")
