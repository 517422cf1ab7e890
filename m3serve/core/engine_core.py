"""EngineCore: everything the engine process holds, and its step.

One object owns the model on its backend, the KV pools, the grammar compiler, the CUDA graphs,
the scheduler, the executor thread and the `StepRunner` that runs a plan on that thread (batch,
forward, sampling, per-slot state: core/step_runner.py). `step()` reads schedule → run →
process; `overlap_step()` is the same three phases with step N+1 launched before step N is
processed, so the host work of one step hides behind the device work of the other. `run()` is
the only place the model is called; it executes on the executor thread, everything else on the
event loop that owns the core.

A constrained request (`SamplingParams.constraint`) waits outside the scheduler while its
grammar compiles on the compiler's thread, so a slow compile holds up no other request; it is
queued once the grammar is ready. Its matcher lives on the executor thread (`core/matchers.py`
says why that is right with overlap on and off).

HiCache (`--enable-hierarchical-cache`): `host` is the host KV tier beside `kv`, over the host
pool that the host-cache actor owns and opens for us (`hicache`, an `ActorLink`), and the
scheduler's prefix cache is the tiered one over both; backups run on the executor thread behind
the steps, a step's load-backs inside its forward, layer by layer (`core/hicache/`). `storage`
runs the L3 tier (with `--hicache-storage-backend`) and notices the actor's death.

Tensor parallelism (`rank`, one engine process per rank): each rank builds its model shard, its
KV pool of its own KV heads and a StepRunner; the ranks agree on the smallest page count any
rank planned. Rank 0 schedules, and `run()` broadcasts each plan before running it; followers
(engine/ranks.py) build the same core, run no scheduler and `follow()` rank 0's plans through
the same StepRunner, which hands rank 0's sampled tokens to every rank (core/ranks.py), and
so rank 0's speculative drafts and verdicts and the image features only rank 0 encodes (the
plan says how many feature rows come: `_keep_media`). Ranks run in lockstep, so with more
than one a failed step is fatal to the engine (raised, not failed request by request), and so
is a lost rank.

Speculative decoding (`spec`, core/spec/engine.py): the draft's KV pool is sized with the
target's pages and shares their ids; every step then runs through the runner's `SpecStep`
(propose, one target forward over each verify row's block, verify, draft KV for the committed
tokens), the scheduler plans decodes as verify rows. `overlap_step` runs them too: the executor
thread starts each decode or verify row at its slot's committed length (core/spec/lengths.py),
which the scheduler, one verdict behind, only bounds. The draft KV is allocated with the
target's, before the host tier, whose pages then hold it too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from m3serve.backends import create_backend
from m3serve.core.executor import Executor
from m3serve.core.grammar import Compiled, Grammar, GrammarCompiler, GrammarUnavailable
from m3serve.core.graphs import DecodeGraphs
from m3serve.core.hicache.prefix_cache import HiPrefixCache
from m3serve.core.hicache.storage_tier import ActorLink, StorageTier, page_key_root
from m3serve.core.hicache.tier import HostTier
from m3serve.core.matchers import GrammarMatchers
from m3serve.core.media import ReqMedia, check_media
from m3serve.core.memory import (
    KVBudget,
    kv_cache_dtype,
    leave_a_core_for_the_scheduler,
    plan_kv_budget,
)
from m3serve.core.piecewise import DEFAULT_MAX_TOKENS, PiecewiseGraphs
from m3serve.core.rank_join import agree_on_pages, join_ranks, leave_ranks, rank_device
from m3serve.core.ranks import LEADER, MediaShare, PlanChannel, TokenShare, follow
from m3serve.core.req import Req
from m3serve.core.sampler import Sampler
from m3serve.core.scheduler import Outputs, QueueFull, Scheduler
from m3serve.core.spec.engine import SpecPlugin
from m3serve.core.spec.warmup import spec_max_step_tokens, spec_warmup_plans
from m3serve.core.step_cost import measure_step_cost
from m3serve.core.step_runner import StepRunner
from m3serve.core.trace import StartupPhases, StepTrace
from m3serve.core.warmup import WarmupLimits, distinct_layers, use_kernel_cache, warmup_plans
from m3serve.model.build import load_model, resolve_device
from m3serve.model.config import load_generation_config
from m3serve.model.kv_cache import KVCache
from m3serve.model.parallel import Parallel, RankGroup
from m3serve.runtime.config import SchedArgs, ServerArgs
from m3serve.runtime.messages import RankAddress, StepPlan, StepResult
from m3serve.runtime.paths import cache_root

log = logging.getLogger(__name__)

DEFAULT_GRAPH_MAX_BS = 128

Launched = tuple[int, "asyncio.Future[StepResult]"]  # a step submitted to the executor
# At shutdown, how long the last L3 writes may take to be handed to the host-cache actor.
FLUSH_S = 10.0


class EngineCore:
    def __init__(
        self,
        args: ServerArgs,
        model_path: Path | None,
        hicache: ActorLink | None = None,
        rank: RankAddress | None = None,
    ) -> None:
        """`hicache`: the host-cache actor, which HiCache needs (it owns the host pool);
        `rank`: this process's place in a tensor-parallel group (None: one rank)."""
        # First, so that every compile from here on is counted and cached on disk.
        self.trace = StepTrace(args.runtime.enable_step_trace)
        use_kernel_cache(cache_root() / "triton")
        self.startup = StartupPhases()
        # ------------------------------------------------------------------ model
        with self.startup.phase("load weights"):
            self.device = resolve_device(args.backend.device)
            self.ranks = RankGroup()
            if rank is not None:
                self.device = rank_device(self.device, rank)
                self.ranks = join_ranks(rank, self.device)
            parallel = Parallel(self.ranks, args.parallel.ep_size)
            self.backend = create_backend(
                args.backend.backend, self.device, args.kernel.moe_runner_backend
            )
            # Progress goes to the server's log: the engine process has no terminal. Only rank
            # 0 encodes images (the followers take its features: core/ranks.py MediaShare).
            self.loaded = load_model(
                model_path,
                self.backend,
                args.model.dtype,
                progress=log,
                parallel=parallel,
                vision=self.ranks.rank == LEADER,
            )
            self.model = self.loaded.model
        cfg = self.model.cfg
        if self.device.type == "cpu":
            leave_a_core_for_the_scheduler(self.ranks.size)
        # ------------------------------------------------------------------ KV pools
        slots = args.sched.max_running_requests
        context = args.runtime.context_length or cfg.max_position_embeddings
        # Speculative decoding: the draft's KV pool shares the pages (core/spec/engine.py).
        self.spec = SpecPlugin.configure(args, self.loaded.path)
        with self.startup.phase("KV pool"):
            kv_dtype = kv_cache_dtype(args.cache.kv_cache_dtype, self.model.dtype)
            self.budget = self._plan_kv(args, kv_dtype, context * slots)
            # One page past the pool is scratch: CUDA-graph padding rows write there.
            self.kv = KVCache.allocate(
                cfg, self.budget.num_pages + 1, kv_dtype, self.device, self.model.kv_heads
            )
            # The draft's KV pool now, so that the host tier below holds it too.
            draft_kv = (
                self.spec.allocate_kv(self.budget, kv_dtype, self.model.dtype, self.device)
                if self.spec is not None
                else None
            )
        log.info("KV pool: %d pages x %d tokens", self.budget.num_pages, self.budget.page_size)
        self.host: HostTier | None = None
        if args.hicache.enable_hierarchical_cache:
            if hicache is None:
                raise ValueError(
                    "--enable-hierarchical-cache needs the host-cache actor, which owns the "
                    "host pool: start the engine through the actor graph (engine/launch.py)"
                )
            with self.startup.phase("host KV pool"):
                self.host = HostTier.create(
                    args.hicache,
                    cfg,
                    self.kv,
                    self.budget.num_pages,
                    hicache.open_pool,
                    lambda job, what: self.executor.call(job, what),
                    draft=draft_kv,
                )
        # ------------------------------------------------------------------ grammars
        # Only rank 0 constrains: the followers take its tokens (core/ranks.py TokenShare).
        leader = self.ranks.rank == LEADER
        self.grammar = self._grammar_compiler(cfg.vocab_size) if leader else None
        self._compiling: list[tuple[Req, bool, Compiled]] = []
        # Compiled grammars of the slots a step starts, from planning to that step's run.
        self._step_grammars: dict[int, dict[int, Grammar]] = {}
        # The images each planned step's prefill chunks need, by slot, until that step runs.
        self._step_media: dict[int, dict[int, list[ReqMedia]]] = {}
        # ------------------------------------------------------------------ the step runner
        self.runner = StepRunner(
            self.model,
            self.kv,
            self.budget.page_size,
            Sampler(slots, cfg.vocab_size, self.device),
            GrammarMatchers(cfg.vocab_size),
            self._step_grammars,
            self.host,
            self._step_media,
        )
        if self.spec is not None:
            with self.startup.phase("DSpark draft"):
                self.spec.attach(self.runner, self.model, self.backend, self.budget, kv_dtype)
        self.plans: PlanChannel | None = None
        if self.ranks.size > 1:
            self.plans = PlanChannel(self.ranks, self.device)
            self.runner.share = TokenShare(self.ranks, self.device)
            hidden = cfg.hidden_size
            self.runner.media_share = MediaShare(self.ranks, self.device, hidden, self.model.dtype)
        # ------------------------------------------------------------------ warm-up
        if self.device.type == "cuda" and not args.kernel.skip_warmup:
            with self.startup.phase("warm-up"):
                self._warm_up(args, context, slots)
        # ------------------------------------------------------------------ CUDA graphs
        with self.startup.phase("CUDA graphs"):
            self.runner.graphs = self._capture_graphs(args, context, slots)
            if self.spec is not None and self.runner.graphs is not None:
                graphs = self.runner.graphs
                pages = self.budget.num_pages  # the scratch page
                self.spec.capture_graphs(graphs.sizes, graphs.max_pages, pages, graphs.pool)
            self.runner.piecewise = self._capture_piecewise(args, slots)
        # ------------------------------------------------------------------ scheduler
        radix = not args.cache.disable_radix_cache
        budget = self._mixed_budget(args, slots)
        pages = self.budget.num_pages
        cache = self.host.prefix_cache(pages, cfg.page_size) if self.host is not None else None
        self.storage = self._storage_tier(args, hicache, cache)
        self.scheduler = Scheduler(
            args.sched,
            pages,
            cfg.page_size,
            radix,
            mixed_budget=budget,
            cache=cache,
            storage=self.storage,
        )
        if self.spec is not None:
            self.scheduler.spec_draft = self.spec.settings.block_size
        # ------------------------------------------------------------------ executor
        self.executor = Executor(self.run)
        self._in_flight: Launched | None = None
        self._ready_compiles = self.trace.compiles.count
        log.info("%s", self.startup.line())

    def info(self) -> dict[str, Any]:
        """What the engine learned at start, for clients (published with Ready)."""
        graphs, piecewise = self.runner.graphs, self.runner.piecewise
        return {
            "max_total_tokens": self.budget.tokens,
            "page_size": self.budget.page_size,
            "backend": self.backend.name,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.device),
            "cuda_graph_bs": graphs.sizes if graphs else [],
            "piecewise_cuda_graph_tokens": piecewise.sizes if piecewise else [],
            "hicache_host_pages": self.host.pool.num_pages if self.host else 0,
            "tp_size": self.ranks.size,
            # Tokens a verify step runs per request (speculative decoding; 0: off).
            "speculative_num_draft_tokens": (
                self.spec.settings.num_draft_tokens if self.spec is not None else 0
            ),
        }

    @property
    def compiles_after_ready(self) -> int:
        """Triton kernels compiled since the engine was ready: the warm-up missed a shape."""
        return self.trace.compiles.count - self._ready_compiles

    # ------------------------------------------------------------------ requests

    def add(self, req: Req, fit_to_pool: bool = False) -> None:
        if req.media:
            self._check_media(req)
        constraint = req.sampling.constraint
        if constraint is None:
            self.scheduler.add(req, fit_to_pool)
            return
        if self.grammar is None:
            raise GrammarUnavailable("this engine cannot run constrained requests (no tokenizer)")
        self.scheduler.check(req, fit_to_pool)
        self._compiling.append((req, fit_to_pool, self.grammar.compile(constraint)))

    def _check_media(self, req: Req) -> None:
        """Refuse image/video input this engine cannot run, or that does not add up (400)."""
        encoder = self.model.vision
        if encoder is None:
            raise ValueError(
                f"the model at {self.loaded.path} has no vision tower: it takes no image or "
                "video input"
            )
        config = self.loaded.config
        ids = {"image": config.image_token_id, "video": config.video_token_id}
        vision = encoder.cfg
        check_media(req.prompt, req.media, ids, vision.patch_dim, vision.spatial_merge_size)

    def abort(self, rid: str) -> None:
        self._compiling = [entry for entry in self._compiling if entry[0].rid != rid]
        self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return bool(self._compiling) or self.scheduler.has_work

    def _queue_compiled(self) -> None:
        """Queue the constrained requests whose grammar is ready; fail those that cannot be."""
        still = []
        for req, fit_to_pool, future in self._compiling:
            if not future.done():
                still.append((req, fit_to_pool, future))
                continue
            try:
                req.grammar = future.result()
                self.scheduler.add(req, fit_to_pool)
            except Exception as exc:
                code = 503 if isinstance(exc, QueueFull) else 400
                self.scheduler.pending_errors.fail(req, f"cannot constrain the output: {exc}", code)
        self._compiling = still

    # ------------------------------------------------------------------ steps

    async def step(self) -> Outputs | None:
        """Schedule → run → process one step; None when there was nothing to run."""
        plan = self._schedule()
        if plan is None:
            return self.scheduler.take_errors()
        return await self._process(self._launch(plan))

    async def overlap_step(self) -> Outputs | None:
        """Schedule and launch step N+1, then process step N, whose tokens the plan of step N+1
        never needed (decode inputs come from the slot table). None when nothing was planned
        and nothing was in flight."""
        plan = self._schedule()
        previous = self._in_flight
        self._in_flight = self._launch(plan) if plan is not None else None
        if previous is None:
            return self.scheduler.take_errors() if plan is None else Outputs()
        return await self._process(previous)

    async def drain(self) -> Outputs | None:
        """Process the step still in flight, if any (before shutting down)."""
        previous, self._in_flight = self._in_flight, None
        return await self._process(previous) if previous is not None else None

    def _schedule(self) -> StepPlan | None:
        started = time.perf_counter()
        if self._compiling:
            self._queue_compiled()
        plan = self.scheduler.schedule()
        if plan is not None:
            self._keep_grammars(plan)
            self._keep_media(plan)
            self.trace.planned(plan, time.perf_counter() - started)
        return plan

    def _keep_grammars(self, plan: StepPlan) -> None:
        """Hand the grammars of the requests this plan starts to its run (keyed by step: the
        executor may still be running an earlier step of the same slot)."""
        new = {seq.slot for seq in plan.seqs if seq.new_request}
        grammars = {
            req.slot: req.grammar
            for req in self.scheduler.running
            if req.slot in new and req.grammar is not None
        }
        if grammars:
            self._step_grammars[plan.step] = grammars

    def _keep_media(self, plan: StepPlan) -> None:
        """Hand the images of this plan's prefill chunks that reach a placeholder to its run."""
        by_slot = {r.slot: r.media for r in self.scheduler.running if r.media}
        if not by_slot:
            return
        media = {
            seq.slot: by_slot[seq.slot]
            for seq in plan.seqs
            if seq.input_ids is not None
            and seq.slot in by_slot
            and any(m.rows_in(seq.start, seq.extend) for m in by_slot[seq.slot])
        }
        if media:
            self._step_media[plan.step] = media
            # How many feature rows the followers of a TP engine receive (core/ranks.py).
            plan.media_rows = sum(
                count
                for seq in plan.seqs
                for item in media.get(seq.slot, [])
                for _, _, count in item.rows_in(seq.start, seq.extend)
            )

    def _launch(self, plan: StepPlan) -> Launched:
        return plan.step, asyncio.wrap_future(self.executor.submit(plan))

    async def _process(self, launched: Launched) -> Outputs:
        step, future = launched
        try:
            result = await future
        except Exception as exc:
            self.trace.processed(step, 0.0)
            if self.plans is not None:
                raise  # the ranks are out of step: the engine cannot go on
            return self.scheduler.fail_step(step, repr(exc))
        started = time.perf_counter()
        outputs = self.scheduler.process(result)
        self.trace.processed(step, time.perf_counter() - started)
        return outputs

    # ------------------------------------------------------------------ run (executor thread)

    def run(self, plan: StepPlan) -> StepResult:
        """One forward over the plan's tokens, and a sampled token for each seq that asks."""
        started, compiles = time.perf_counter(), self.trace.compiles.count
        if self.plans is not None:
            self.plans.send(plan)  # the followers run it with us
        result = self.runner.run(plan)
        self.trace.ran(plan.step, time.perf_counter() - started, compiles)
        return result

    def follow(self) -> int:
        """A follower rank's whole life after start: run rank 0's plans, in order, until it
        says stop; the number of plans run. Raises `RankLost` when another rank dies."""
        assert self.plans is not None and self.ranks.rank != LEADER
        return follow(self.plans, self.runner.run)

    def _plan_kv(self, args: ServerArgs, kv_dtype: torch.dtype, useful: int) -> KVBudget:
        """This rank's KV budget (its own KV heads only), then the smallest over the ranks."""
        budget = plan_kv_budget(
            self.model.cfg,
            self.device,
            args.cache.max_total_tokens,
            args.cache.mem_fraction_static,
            kv_dtype,
            max_useful_tokens=useful,
            kv_heads=self.model.kv_heads,
            extra_page_bytes=(
                self.spec.page_bytes(kv_dtype, self.model.cfg.page_size) if self.spec else 0
            ),
        )
        pages = agree_on_pages(self.ranks, budget.num_pages, self.device)
        return KVBudget(pages, budget.page_size)

    def _warm_up(self, args: ServerArgs, context: int, slots: int) -> None:
        """Run every step shape class once (core/warmup.py), so no request waits for a compile:
        one layer of each kind suffices, since layers of a kind launch the same kernels."""
        most = self._max_step_tokens(args.sched, slots)
        spec = self.spec.step if self.spec is not None else None
        if spec is not None:  # verify rows carry γ drafts each
            most = spec_max_step_tokens(most, slots, spec.gamma, self.budget.tokens)
        limits = WarmupLimits(
            page_size=self.budget.page_size,
            num_pages=self.budget.num_pages,
            max_running=slots,
            max_step_tokens=most,
            context=min(context, self.budget.tokens),
        )
        cfg = self.model.cfg
        layers = distinct_layers(cfg.layer_types, cfg.mlp_layer_types)
        before, steps = self.trace.compiles.count, 0
        plans: Iterable[StepPlan] = warmup_plans(limits)
        if spec is not None:  # the verify-step shapes, through the same SpecStep
            plans = itertools.chain(plans, spec_warmup_plans(limits, spec.gamma))
        for plan in plans:
            if spec is not None:
                spec.lengths.place(plan.seqs)
            self.runner.run(plan, layers)
            steps += 1
        torch.cuda.synchronize(self.device)
        compiled = self.trace.compiles.count - before
        self.startup.note("warm-up", f"{steps} steps on layers {layers}, {compiled} kernels")

    def _max_step_tokens(self, sched: SchedArgs, slots: int) -> int:
        """The most tokens one step can carry: a prefill budget of chunks and every decode."""
        prefill = sched.max_prefill_tokens  # unchunked, longer prompts are refused
        if sched.chunked_prefill_size > 0:
            prefill = min(prefill, sched.chunked_prefill_size)
        return min(prefill + slots, self.budget.tokens)

    def _grammar_compiler(self, vocab_size: int) -> GrammarCompiler | None:
        """The compiler for this model's tokenizer; None (constrained requests refused) when
        the checkpoint has no usable tokenizer."""
        path = self.loaded.path
        eos = set(self.loaded.config.text.eos_token_ids)
        eos |= set(load_generation_config(path).eos_token_ids)
        try:
            return GrammarCompiler.for_model(path, vocab_size, sorted(eos))
        except GrammarUnavailable as exc:
            log.info("structured output is off: %s", exc)
            return None

    def _capture_graphs(self, args: ServerArgs, context: int, slots: int) -> DecodeGraphs | None:
        kernel = args.kernel
        max_bs = kernel.cuda_graph_max_bs_decode or DEFAULT_GRAPH_MAX_BS
        if kernel.disable_cuda_graph or not self.backend.capturable:
            return None
        max_pages = min(-(-context // self.budget.page_size), self.budget.num_pages)
        graphs = DecodeGraphs(
            self.model, self.kv, self.budget.num_pages, min(max_bs, slots), max_pages
        )
        graphs.capture()
        return graphs

    def _capture_piecewise(self, args: ServerArgs, slots: int) -> PiecewiseGraphs | None:
        kernel = args.kernel
        off = kernel.disable_cuda_graph or kernel.cuda_graph_backend_prefill == "disabled"
        if off or not self.backend.capturable:
            return None
        largest = self._max_step_tokens(args.sched, slots)
        wanted = kernel.cuda_graph_max_bs_prefill or DEFAULT_MAX_TOKENS
        piecewise = PiecewiseGraphs(
            self.model, self.kv, self.budget.num_pages, min(wanted, largest)
        )
        piecewise.capture()
        return piecewise

    def _mixed_budget(self, args: ServerArgs, slots: int) -> Callable[[int], int] | None:
        """The scheduler's prompt budget for steps that decode, from step times measured now
        (GPU only: on a CPU the forward is too noisy to time, and nobody streams from it)."""
        stretch = args.sched.mixed_step_stretch
        if not stretch or self.device.type != "cuda" or args.sched.chunked_prefill_size < 0:
            return None
        if self.ranks.size > 1:  # timed on rank 0 alone, its forwards would wait on the others
            return None
        page = self.budget.page_size
        graphs = self.runner.graphs
        sizes = graphs.sizes if graphs else [1, 8, 32, 64, 128]
        with self.startup.phase("step cost"):
            cost = measure_step_cost(
                self.runner.time_step,
                lambda: torch.cuda.synchronize(self.device),
                [s for s in sizes if s <= slots],
                page,
                self.budget.num_pages,
                self._max_step_tokens(args.sched, slots),
            )
        log.info("%s", cost.describe(stretch, page))
        return lambda decodes: cost.mixed_budget(decodes, stretch, page)

    def _storage_tier(
        self, args: ServerArgs, hicache: ActorLink | None, cache: HiPrefixCache | None
    ) -> StorageTier | None:
        """The L3 tier (with a storage backend) and the watch on the host-cache actor."""
        if hicache is None or cache is None or self.host is None:
            return None
        l3 = args.hicache.hicache_storage_backend is not None
        draft = self.spec.draft_dir if self.spec is not None else None
        root = page_key_root(self.loaded.path, self.host.pool.layout, draft) if l3 else None
        return StorageTier(hicache.client, cache, root, on_disabled=self.host.disable)

    # ------------------------------------------------------------------ shutdown

    async def flush_storage(self, timeout_s: float = FLUSH_S) -> None:
        """Before shutdown, while the host-cache actor still runs: the backups queued so far
        run, and the L3 writes behind them are sent (the client's close waits for them)."""
        storage = self.storage
        if storage is None or not storage.has_work:
            return
        await asyncio.wrap_future(self.executor.call(lambda: None, "HiCache flush"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        storage.poll()
        while storage.has_work and loop.time() < deadline:
            await asyncio.sleep(0.005)  # a CUDA copy's event is not done yet
            storage.poll()

    def close(self) -> None:
        """Stop the executor and free the device memory now: an embedding process may start
        another engine next. Rank 0 of several tells the followers to stop first."""
        self.executor.close()
        if self.plans is not None:
            self._leave()
        if self.host is not None:
            self.host.close()
        self.trace.close()
        if self.grammar is not None:
            self.grammar.close()
        del self.runner, self.kv, self.model, self.loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _leave(self) -> None:
        assert self.plans is not None
        if self.ranks.rank == LEADER:
            try:
                self.plans.send(None)
            except Exception as exc:  # a follower already gone: nothing left to tell
                log.warning("could not stop the follower ranks: %s", exc)
        leave_ranks()
