"""The CPU budget of a tokenizer worker's media preprocessing.

`--tokenizer-worker-num` worker processes share the machine's cores; torch's default intra-op
pool is every core in each of them, so N workers resizing at once run N x cores threads and
thrash. Each worker process sizes its pool to its share, cores // N (at least 1), and runs one
preprocessing at a time (`MediaPreprocessor`'s single-thread executor), so its media work never
uses more than that share.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, as a container's cpuset sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_threads(workers: int, cpus: int | None = None) -> int:
    """One worker's share of `cpus` (default: the usable cores) among `workers`."""
    return max(1, (cpus if cpus is not None else usable_cpus()) // max(1, workers))


def bound_worker_threads(workers: int) -> int:
    """Size this process's torch pool to one worker's share; returns the thread count. Only for
    a worker process of its own: single-process, the pool is the model's too."""
    import torch

    threads = worker_threads(workers)
    torch.set_num_threads(threads)
    return threads
