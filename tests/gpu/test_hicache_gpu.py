"""HiCache copies on a GPU: the pinned host pool, backups on the side stream with an event, and
a load-back whose layers the forward's stream waits for one by one, inside a real forward (the
logits equal one forward over the whole prompt). Also the engine end to end on CUDA."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.hf_oracle import random_prompt
from helpers.hicache_workload import GREEDY, PREFIX, PROMPTS, SMALL_POOL

from m3serve import Engine
from m3serve.backends.reference import ReferenceBackend
from m3serve.core.hicache.cuda_copier import CudaCopier
from m3serve.core.hicache.host_pool import HostKVPool, model_layout
from m3serve.core.hicache.tickets import Ticket
from m3serve.core.hicache.tier import device_tensors
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

SPEC = TinySpec(dtype="float32", seed=1)


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.fixture(scope="module")
def model(path: Path) -> M3ForCausalLM:
    backend = ReferenceBackend(torch.device("cuda"))
    return load_model(path, backend, "float32", progress=False).model


@pytest.fixture
def setup(model: M3ForCausalLM) -> Iterator[tuple[KVCache, CudaCopier]]:
    kv = KVCache.allocate(model.cfg, 12, torch.float32, "cuda")
    layout = model_layout(model.cfg, torch.float32)
    pool = HostKVPool.create("gpucopiertest", layout, num_pages=8)
    copier = CudaCopier(pool, device_tensors(kv, layout))
    assert pool.views[0].is_pinned()
    yield kv, copier
    copier.close()
    pool.close()


@torch.inference_mode()
def test_load_back_on_the_side_stream_layer_by_layer(
    model: M3ForCausalLM, setup: tuple[KVCache, CudaCopier]
) -> None:
    kv, copier = setup
    ps = model.cfg.page_size
    ids = random_prompt(901, 5 * ps + 3, model.cfg.vocab_size - 64)
    first, host, again = [3, 7, 1, 8, 5], [6, 0, 2, 4, 1], [9, 4, 0, 6, 10]
    model(ForwardBatch.build([SeqStep(ids[: 5 * ps], 0, first)], ps, "cuda"), kv)
    backup = Ticket(1, "backup", first, host)
    backup.settle(copier.backup(backup))
    backup.wait()
    assert backup.done()
    for layer in kv.layers:
        for t in (layer.k, layer.v, layer.index_k):
            if t is not None:
                t.zero_()  # the device forgets the prefix
    load_back = Ticket(2, "load", again, host)
    load = copier.start_load([load_back])
    waited: list[int] = []

    def before_layer(layer: int) -> None:
        load.before_layer(layer)
        waited.append(layer)

    step = SeqStep(ids[5 * ps :], 5 * ps, [*again, 11])
    logits = model(ForwardBatch.build([step], ps, "cuda"), kv, before_layer=before_layer)
    load.finish()
    load_back.wait()
    assert waited == list(range(len(kv.layers))) and load_back.done()
    whole = KVCache.allocate(model.cfg, 12, torch.float32, "cuda")
    expected = model(ForwardBatch.build([SeqStep(ids, 0, list(range(6)))], ps, "cuda"), whole)
    torch.testing.assert_close(logits[-1], expected[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_the_engine_reloads_an_evicted_prefix_on_cuda(path: Path, policy: str) -> None:
    common = {"single_process": True, "device": "cuda", "dtype": "float32", "skip_warmup": True}

    def run(**args: object) -> list[dict]:
        with Engine(str(path), **common, **args) as engine:
            return [engine.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS]

    big = run()
    small = run(
        max_total_tokens=SMALL_POOL, enable_hierarchical_cache=True, hicache_write_policy=policy
    )
    assert [o["output_ids"] for o in small] == [o["output_ids"] for o in big]
    assert small[-1]["meta_info"]["cached_tokens"] == len(PREFIX)
