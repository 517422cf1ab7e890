"""Image preprocessing throughput of the tokenizer workers: encoded 1024x1024 images (PNG and
JPEG) through decode + smart resize + normalize + patchify, as one worker does it per image, in
1 and in 4 worker processes at once. Each process sizes torch's thread pool as a tokenizer
worker does (`bounded`: its share of the cores, `bound_worker_threads`) or leaves torch's
default of every core in every process (`default`, the oversubscribed way workers ran before).

    python perf/bench_preprocess.py                 # 1 and 4 workers, bounded, 2 s per level
    python perf/bench_preprocess.py --threads default,bounded --seconds 5 --out /tmp/pre.json

Prints images/s per level (all workers together and per worker) and the per-image time; the
ratio of 4 workers to 1 is the scaling the machine's cores give. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
from PIL import Image

from m3serve.actors.preprocess_threads import bound_worker_threads
from m3serve.model.vision.processor import process_image_bytes
from m3serve.model.vision.processor_config import ImageProcessorConfig


def _image(fmt: str, side: int = 1024) -> bytes:
    rng = np.random.default_rng(0)
    smooth = np.linspace(0, 255, side, dtype=np.float32)[None, :, None]
    pixels = np.clip(smooth + rng.normal(0, 20, (side, side, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _worker(
    blob: bytes, seconds: float, workers: int, threads: str, start_line: Any, out: mp.Queue
) -> None:
    if threads == "bounded":  # as a tokenizer worker process sizes its pool
        bound_worker_threads(workers)
    config = ImageProcessorConfig()
    process_image_bytes(blob, config)  # first call pays imports and allocations
    start_line.wait()  # all workers timed together, not one after another as they spawn
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        process_image_bytes(blob, config)
        done += 1
    out.put((done, time.perf_counter() - start))


def level(blob: bytes, workers: int, seconds: float, threads: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    work = (blob, seconds, workers, threads, ctx.Barrier(workers), out)
    procs = [ctx.Process(target=_worker, args=work) for _ in range(workers)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    per_worker = [n / t for n, t in results]
    return {
        "threads": threads,
        "workers": workers,
        "images_per_s": sum(per_worker),
        "images_per_s_per_worker": sum(per_worker) / workers,
        "ms_per_image": 1000 * sum(t for _, t in results) / sum(n for n, _ in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,4", help="comma-separated worker counts")
    parser.add_argument(
        "--threads", default="bounded", help="comma-separated torch pool sizings: default,bounded"
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="time per level")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    rows = []
    for fmt in ("PNG", "JPEG"):
        blob = _image(fmt)
        for threads in args.threads.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                rows.append({"format": fmt, **level(blob, workers, args.seconds, threads)})
    print(f"1024x1024 image preprocessing on {os.cpu_count()} CPUs")
    print(
        f"{'format':<6} {'threads':<8} {'workers':>7} {'images/s':>9} {'per worker':>10} "
        f"{'ms/image':>9}"
    )
    for r in rows:
        print(
            f"{r['format']:<6} {r['threads']:<8} {r['workers']:>7} {r['images_per_s']:>9.1f} "
            f"{r['images_per_s_per_worker']:>10.1f} {r['ms_per_image']:>9.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpus": os.cpu_count(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
