"""The engine core's start-up decisions, each from the server args and the parts built before
it: the KV budget the ranks agree on, the grammar compiler, the decode and piecewise CUDA
graphs, the scheduler's mixed-step prompt budget (from step times measured now), the L3
storage tier, and the warm-up pass that compiles every kernel variant before ready.

`EngineCore.__init__` (core/engine_core.py) calls them in order; they hold no state."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from m3serve.core.grammar import GrammarCompiler, GrammarUnavailable
from m3serve.core.graphs import DecodeGraphs, GraphDraw, buckets_up_to
from m3serve.core.head_draw import HeadDraws
from m3serve.core.hicache.prefix_cache import HiPrefixCache
from m3serve.core.hicache.storage_tier import ActorLink, StorageTier, page_key_root
from m3serve.core.hicache.tier import HostTier
from m3serve.core.memory import KVBudget, plan_kv_budget
from m3serve.core.mixed_budget import MixedBudget
from m3serve.core.piecewise import DEFAULT_MAX_TOKENS, PiecewiseGraphs
from m3serve.core.prefill_demand import PrefillDemand
from m3serve.core.rank_join import agree_on_pages
from m3serve.core.spec.engine import SpecPlugin
from m3serve.core.spec.warmup import spec_max_step_tokens, spec_warmup_plans
from m3serve.core.step_cost import budget_quantum, measure_step_cost
from m3serve.core.step_runner import StepRunner
from m3serve.core.trace import StartupPhases
from m3serve.core.warmup import WarmupLimits, distinct_layers, warmup_plans
from m3serve.core.warmup_record import Recorder
from m3serve.model.backend import Backend
from m3serve.model.build import LoadedModel
from m3serve.model.config import load_generation_config
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.parallel import RankGroup
from m3serve.runtime.config import SchedArgs, ServerArgs
from m3serve.runtime.messages import SamplingParams, StepPlan

log = logging.getLogger(__name__)

DEFAULT_GRAPH_MAX_BS = 128


def plan_kv(
    args: ServerArgs,
    model: M3ForCausalLM,
    device: torch.device,
    ranks: RankGroup,
    kv_dtype: torch.dtype,
    useful: int,
    spec: SpecPlugin | None,
) -> KVBudget:
    """This rank's KV budget (its own KV heads only), then the smallest over the ranks."""
    budget = plan_kv_budget(
        model.cfg,
        device,
        args.cache.max_total_tokens,
        args.cache.mem_fraction_static,
        kv_dtype,
        max_useful_tokens=useful,
        kv_heads=model.kv_heads,
        extra_page_bytes=spec.page_bytes(kv_dtype, model.cfg.page_size) if spec else 0,
    )
    pages = agree_on_pages(ranks, budget.num_pages, device)
    return KVBudget(pages, budget.page_size)


def max_step_tokens(sched: SchedArgs, slots: int, budget: KVBudget) -> int:
    """The most tokens one step can carry: a prefill budget of chunks and every decode."""
    prefill = sched.max_prefill_tokens  # unchunked, longer prompts are refused
    if sched.chunked_prefill_size > 0:
        prefill = min(prefill, sched.chunked_prefill_size)
    return min(prefill + slots, budget.tokens)


def grammar_compiler(loaded: LoadedModel, vocab_size: int) -> GrammarCompiler | None:
    """The compiler for this model's tokenizer; None (constrained requests refused) when the
    checkpoint has no usable tokenizer."""
    path = loaded.path
    eos = set(loaded.config.text.eos_token_ids)
    eos |= set(load_generation_config(path).eos_token_ids)
    try:
        return GrammarCompiler.for_model(path, vocab_size, sorted(eos))
    except GrammarUnavailable as exc:
        log.info("structured output is off: %s", exc)
        return None


@dataclass(frozen=True)
class WarmedUp:
    steps: int  # plans run
    plans: int  # plans in the whole pass
    layers: list[int]  # the layers they ran on
    recorded: bool  # the plans run were those a record named (core/warmup_record.py)


def warm_up(
    args: ServerArgs,
    runner: StepRunner,
    budget: KVBudget,
    spec: SpecPlugin | None,
    context: int,
    slots: int,
    recorder: Recorder | None = None,
) -> WarmedUp:
    """Run every step shape class once (core/warmup.py), so no request waits for a compile:
    one layer of each kind suffices, since layers of a kind launch the same kernels. With a
    `recorder`, only the plans its record names where it has one, else the whole pass, noting
    the plans that brought in a kernel for the next start (core/warmup_record.py)."""
    most = max_step_tokens(args.sched, slots, budget)
    step = spec.step if spec is not None else None
    if step is not None:  # verify rows carry γ drafts each
        most = spec_max_step_tokens(most, slots, step.gamma, budget.tokens)
    limits = WarmupLimits(
        page_size=budget.page_size,
        num_pages=budget.num_pages,
        max_running=slots,
        max_step_tokens=most,
        context=min(context, budget.tokens),
    )
    cfg = runner.model.cfg
    layers = distinct_layers(cfg.layer_types, cfg.mlp_layer_types)
    plans: Iterable[StepPlan] = warmup_plans(limits)
    if step is not None:  # the verify-step shapes, through the same SpecStep
        plans = itertools.chain(plans, spec_warmup_plans(limits, step.gamma))
    record = None
    chosen: frozenset[int] | None = None
    if recorder is not None:
        record = recorder.record(limits, layers, step.gamma if step is not None else 0)
        chosen = recorder.agree(None if args.kernel.full_warmup else record.load())
    compiles = recorder.compiles if recorder is not None else lambda: 0
    steps = total = 0
    loaded: list[int] = []  # the plans after which a kernel had come in
    for index, plan in enumerate(plans):
        total += 1
        if chosen is None or index in chosen:
            before = compiles()
            if step is not None:
                step.lengths.place(plan.seqs)
            runner.run(plan, layers)
            steps += 1
            if compiles() > before:
                loaded.append(index)
    if recorder is not None and record is not None and chosen is None:
        recorder.save(record, total, loaded)
    # The plans draw at half their batch sizes (rows alternate greedy and sampled); which
    # kernels a draw takes depends on its rows.
    runner.sampler.warm_up()
    return WarmedUp(steps, total, layers, chosen is not None)


def capture_graphs(
    args: ServerArgs,
    backend: Backend,
    model: M3ForCausalLM,
    kv: KVCache,
    budget: KVBudget,
    context: int,
    slots: int,
    draw: GraphDraw | None = None,
) -> DecodeGraphs | None:
    """The decode CUDA graphs (drawing their rows' tokens themselves with `draw`); None where
    they are off or the backend cannot capture."""
    kernel = args.kernel
    max_bs = kernel.cuda_graph_max_bs_decode or DEFAULT_GRAPH_MAX_BS
    if kernel.disable_cuda_graph or not backend.capturable:
        return None
    max_pages = min(-(-context // budget.page_size), budget.num_pages)
    graphs = DecodeGraphs(model, kv, budget.num_pages, min(max_bs, slots), max_pages, draw)
    graphs.capture()
    return graphs


def capture_piecewise(
    args: ServerArgs,
    backend: Backend,
    model: M3ForCausalLM,
    kv: KVCache,
    budget: KVBudget,
    slots: int,
) -> PiecewiseGraphs | None:
    """The piecewise prefill CUDA graphs; None where they are off or cannot be captured."""
    kernel = args.kernel
    off = kernel.disable_cuda_graph or kernel.cuda_graph_backend_prefill == "disabled"
    if off or not backend.capturable:
        return None
    largest = max_step_tokens(args.sched, slots, budget)
    wanted = kernel.cuda_graph_max_bs_prefill or DEFAULT_MAX_TOKENS
    piecewise = PiecewiseGraphs(model, kv, budget.num_pages, min(wanted, largest))
    piecewise.capture()
    return piecewise


def capture_heads(
    model: M3ForCausalLM, runner: StepRunner, draw: GraphDraw | None, slots: int
) -> HeadDraws | None:
    """The piecewise steps' draw graphs (core/head_draw.py), in the decode graphs' memory pool
    and for their batch sizes (so that their logits are bounded as the decode graphs' are: a
    step sampling more rows draws outside them); None without piecewise graphs or a draw."""
    piecewise = runner.piecewise
    if piecewise is None or draw is None or not piecewise.capture_graphs:
        return None
    graphs = runner.graphs
    sizes = graphs.sizes if graphs is not None else buckets_up_to(min(slots, DEFAULT_GRAPH_MAX_BS))
    heads = HeadDraws(model, piecewise.buffers.hidden, draw, sizes)
    pool = heads.capture(graphs.pool if graphs is not None else None)
    if graphs is not None:
        graphs.pool = pool
    return heads


def default_sampling(model_dir: Path) -> SamplingParams:
    """The sampling a request that sets none of its fields gets: the checkpoint's
    generation_config.json defaults (as api/sampling.py applies them)."""
    fields = load_generation_config(model_dir).sampling
    return SamplingParams(**{k: int(v) if k == "top_k" else float(v) for k, v in fields.items()})


def mixed_budget(
    args: ServerArgs,
    device: torch.device,
    runner: StepRunner,
    budget: KVBudget,
    startup: StartupPhases,
    slots: int,
    model_dir: Path,
) -> MixedBudget | None:
    """The scheduler's prompt budget for steps that decode, from step times measured now and
    then from the steps served (GPU only: on a CPU the forward is too noisy to time, and nobody
    streams from it). With several ranks every rank times the same steps in the same order
    (each forward's collectives need them all); only rank 0's budget is used, since only rank 0
    schedules, and its times include the collectives as served steps do."""
    stretch = args.sched.mixed_step_stretch
    if not stretch or device.type != "cuda" or args.sched.chunked_prefill_size < 0:
        return None
    page = budget.page_size
    graphs = runner.graphs
    sizes = graphs.sizes if graphs else [1, 8, 32, 64, 128]
    with startup.phase("step cost"):
        sampling = default_sampling(model_dir)
        cost = measure_step_cost(
            lambda seqs: runner.time_step(seqs, sampling),
            lambda: torch.cuda.synchronize(device),
            [s for s in sizes if s <= slots],
            page,
            budget.num_pages,
            max_step_tokens(args.sched, slots, budget),
            runner.model.cfg.vocab_size,
        )
    quantum = budget_quantum(page)
    margin = args.sched.mixed_step_demand_margin
    demand = PrefillDemand(margin) if margin else None
    served = MixedBudget(cost, stretch, quantum, args.sched.mixed_step_min_tokens, demand)
    floor = f"; never below {served.floor} tokens" if served.floor else ""
    cap = f"; at most {margin} x what the decode rows consume" if demand is not None else ""
    log.info("%s%s%s", cost.describe(stretch, quantum), floor, cap)
    return served


def storage_tier(
    args: ServerArgs,
    hicache: ActorLink | None,
    cache: HiPrefixCache | None,
    host: HostTier | None,
    model_path: Path,
    spec: SpecPlugin | None,
) -> StorageTier | None:
    """The L3 tier (with a storage backend) and the watch on the host-cache actor."""
    if hicache is None or cache is None or host is None:
        return None
    l3 = args.hicache.hicache_storage_backend is not None
    draft = spec.draft_dir if spec is not None else None
    root = page_key_root(model_path, host.pool.layout, draft) if l3 else None
    return StorageTier(hicache.client, cache, root, on_disabled=host.disable)
