"""Start-up checks of an engine's settings against its model, run before any actor is spawned
and off the caller's event loop."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from m3serve.runtime.config import ConfigInvalid, ServerArgs

if TYPE_CHECKING:
    import torch

    from m3serve.model.config import ModelConfig


async def checked_off_the_loop(args: ServerArgs) -> Path:
    """`checked_model_path` without stalling the event loop. Importing torch holds the GIL for
    up to a second at a time even in a worker thread, so a process that has not imported it
    (the API server, a script driving actor processes) checks in a short-lived child process
    and never imports torch itself; otherwise a worker thread does."""
    if args.runtime.single_process or "torch" in sys.modules:
        return await asyncio.to_thread(checked_model_path, args)
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, checked_model_path, args)
    finally:
        await asyncio.to_thread(pool.shutdown)  # the child's exit is waited for off the loop


def checked_model_path(args: ServerArgs) -> Path:
    """The model's directory, once every setting is known to work with it: a start fails here,
    with the component's own message, before any actor is spawned."""
    from m3serve.backends import check_backend
    from m3serve.core.spec.settings import resolve_spec
    from m3serve.model.build import resolve_device
    from m3serve.model.config import load_model_config
    from m3serve.model.locate import resolve_model_path
    from m3serve.model.tiny.default import default_model_path

    args.check_supported()
    path, revision = args.model.model_path, args.model.revision
    model_path = resolve_model_path(path, revision) if path else default_model_path()
    config = load_model_config(model_path)
    page_size = args.cache.page_size
    if page_size is not None and page_size != config.text.page_size:
        raise ConfigInvalid(
            f"--page-size {page_size}: this model's KV page is its sparse block, "
            f"{config.text.page_size} tokens"
        )
    device = resolve_device(args.backend.device)
    check_parallel(args, config, device)
    backend = check_backend(args.backend.backend, device, args.kernel.moe_runner_backend)
    if args.cache.kv_cache_dtype == "fp8_e4m3" and backend != "hopper":
        raise ConfigInvalid("--kv-cache-dtype fp8_e4m3 needs the hopper backend")
    resolve_spec(args, model_path, quiet=True)  # refuses what speculative decoding cannot run
    return model_path


def check_parallel(args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
    """--tp / --ep against the model's head, expert and width counts and the GPUs there are:
    every problem in one message."""
    import torch

    from m3serve.model.parallel import parallel_problems

    tp, ep = args.parallel.tp_size, args.parallel.ep_size
    problems = parallel_problems(config.text, tp, ep, quantized=config.quant is not None)
    if device.type == "cuda" and tp > torch.cuda.device_count():
        problems.append(f"--tp {tp} needs {tp} GPUs; {torch.cuda.device_count()} are visible")
    if tp > 1:
        problems.extend(_rank_problems(args, device))
    if problems:
        raise ConfigInvalid(f"--tp {tp} --ep {ep} cannot run this model: " + "; ".join(problems))


def _rank_problems(args: ServerArgs, device: torch.device) -> list[str]:
    """What an engine of several ranks cannot do yet in this build."""
    problems = []
    if args.runtime.single_process:
        problems.append("--tp > 1 needs one engine process per rank, not --single-process")
    return problems
