"""The serving benchmarks' shared parts (perf/bench_serving.py, perf/bench_agentic.py): one
streamed OpenAI request and its stamps (client), prompts of exact token counts (prompts), the
load shapes (load), statistics and level summaries (stats), tables and plots (report).

Imported as `serving.…` with perf/ on sys.path, as it is when a benchmark runs by path.
"""
