"""Whether a prompt chunk's forward hides beside a decode step's when the two run at once on two
CUDA streams, against the mixed step that runs them as one batch (run on the GPU).

Issue 11's share at concurrency 64 is bounded by what a mixed step adds per prompt token: on
the 4-layer slice ~5.8 µs a token past the decode step (an H100, 2026-12-06), 82 % of the dense
bf16 matmul rate, so batching prompt tokens into the decode step cannot reach 85 % of the decode
ideal. The decode step itself is not bound by its matmuls (64 rows x 3.15 GFLOP in 2.2 ms): a
prompt chunk run beside it, on its own stream, might fill what the decode step leaves idle. This
measures that on the engine's step path (`bench_mixed_step.runner_for`: the checkpoint loaded as
the server loads it, the decode CUDA graphs and the piecewise graphs captured), device time
only, for each prompt size P:

* decode: the decode graph's replay of `--batch` rows over `--context` tokens;
* prefill: the P-token prompt's forward alone (eager: the graphs' memory pool is not shared
  with a forward running at the same time);
* mixed: the rows and the prompt as one batch (piecewise graphs), as the server runs them;
* beside: the decode graph on the current stream and the prompt's forward on a second one,
  both released at once.

Each is timed from its release to its end by CUDA events: the streams first wait behind a spin
kernel (`torch.cuda._sleep`) long enough for the host to queue all the work, so no timing
holds host launch time. "hidden" is the share of the shorter of decode and prefill that beside
saves against running them one after the other. The first run (an H100, 2026-12-06, batch 16
and 64, prompts of 128-512 tokens) hid 28-47 %, yet beside was 5-17 % slower than mixed at every
point: batching stays the cheaper way (perf/results/h100_2026-12-06i_overlap_rows/).

    python perf/bench_overlap_step.py --model-path DIR [--batch 64] [--prompts 128 296 512]
        [--context 1024] [--repeats 10] [--no-mxfp8-bf16-copy] [--out PATH]

Prints a table; writes JSON to $OUT/bench_overlap_step.json when $OUT is set, else
perf/results/ (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_mixed_step import add_copy_flag, runner_for, step
from result_json import write_result

from m3serve.core.step_runner import StepRunner
from m3serve.kernels.triton.router import GEMV_MAX_TOKENS
from m3serve.model.batch import ForwardBatch

# Spin cycles ahead of each timed release (~10 ms at H100/H200 clocks): longer than the host
# takes to queue a 4-layer prompt forward; a release that came later is reported.
SPIN_CYCLES = 20_000_000


def released(work: list[tuple[torch.cuda.Stream, Callable[[], Any]]]) -> tuple[float, float]:
    """(device ms from the release to the last stream's end, host ms queueing the work): every
    stream waits for a spin on the first one, then runs its callable."""
    first = work[0][0]
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in work]
    with torch.cuda.stream(first):
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
    began = time.perf_counter()
    for (stream, call), end in zip(work, ends, strict=True):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            call()
            end.record()
    host = 1e3 * (time.perf_counter() - began)
    torch.cuda.synchronize()
    return max(start.elapsed_time(end) for end in ends), host


def spin_ms() -> float:
    """Device ms of one spin (`SPIN_CYCLES`) at this GPU's clock."""
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    torch.cuda._sleep(SPIN_CYCLES)
    after.record()
    torch.cuda.synchronize()
    return before.elapsed_time(after)


def median_ms(
    work: list[tuple[torch.cuda.Stream, Callable[[], Any]]], repeats: int
) -> tuple[float, float]:
    """Median device ms of `repeats` releases (after one untimed), and the slowest host ms."""
    released(work)
    runs = [released(work) for _ in range(repeats)]
    return statistics.median(d for d, _ in runs), max(h for _, h in runs)


def measure(
    runner: StepRunner, batch: int, prompt: int, context: int, repeats: int
) -> dict[str, float]:
    """The four timings of the module docstring for one prompt size."""
    assert runner.graphs is not None, "the decode graphs are captured on a GPU only"
    page, vocab, device = runner.page_size, runner.model.cfg.vocab_size, runner.device
    seqs = step(batch, prompt, page, context, vocab)
    rows = ForwardBatch.build(seqs[:batch], page, device)
    chunk = ForwardBatch.build(seqs[batch:], page, device)
    both = ForwardBatch.build(seqs, page, device)
    if not runner.graphs.fits(rows):
        raise ValueError(f"no decode graph holds {batch} rows over {context} tokens")
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)

    def decode() -> None:
        runner.graphs.run(rows)  # type: ignore[union-attr]

    def prefill() -> None:
        runner.model(chunk, runner.kv)

    def mixed() -> None:
        runner.logits(both, decode_only=False)

    times = {
        "decode": median_ms([(main, decode)], repeats),
        "prefill": median_ms([(main, prefill)], repeats),
        "mixed": median_ms([(main, mixed)], repeats),
        "beside": median_ms([(main, decode), (side, prefill)], repeats),
    }
    row = {f"{name}_ms": ms for name, (ms, _) in times.items()}
    row["host_ms_max"] = max(host for _, host in times.values())
    serial = row["decode_ms"] + row["prefill_ms"]
    row["hidden"] = (serial - row["beside_ms"]) / min(row["decode_ms"], row["prefill_ms"])
    return {"batch": batch, "prompt": prompt, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 296, 512])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    add_copy_flag(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_overlap_step.py times CUDA streams: run it on the GPU")
    if min(args.batch, *args.prompts) <= GEMV_MAX_TOKENS:
        # The router's GEMV route counts its programs in one int32 per device: two of its
        # calls at once, one a stream, would corrupt each other's routing.
        raise SystemExit(f"--batch and --prompts must exceed {GEMV_MAX_TOKENS} tokens")
    runner = runner_for(
        args.model_path, [args.batch], max(args.prompts), args.context, args.mxfp8_bf16_copy
    )
    spin = spin_ms()
    print(f"{torch.cuda.get_device_name()}; spin ahead of each release {spin:.1f} ms")
    print(
        f"{'batch':>5} {'prompt':>6} {'decode':>8} {'prefill':>8} {'mixed':>8} {'beside':>8} "
        f"{'hidden':>7} {'host max':>9}   (device ms)"
    )
    rows = []
    with torch.inference_mode():
        for prompt in args.prompts:
            r = measure(runner, args.batch, prompt, args.context, args.repeats)
            rows.append(r)
            late = "  (host slower than the spin)" if r["host_ms_max"] > spin else ""
            print(
                f"{r['batch']:5d} {r['prompt']:6d} {r['decode_ms']:8.2f} {r['prefill_ms']:8.2f} "
                f"{r['mixed_ms']:8.2f} {r['beside_ms']:8.2f} {100 * r['hidden']:6.1f}% "
                f"{r['host_ms_max']:9.2f}{late}"
            )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model_path": args.model_path,
        "context": args.context,
        "spin_ms": spin,
        "rows": rows,
    }
    write_result(result, "bench_overlap_step.json", args.out)


if __name__ == "__main__":
    main()
