"""EngineCore: everything the engine process holds, built at start, and its shutdown.

One object owns the model on its backend, the KV pools, the grammar compiler, the CUDA graphs,
the scheduler, the executor thread and the `StepRunner` that runs a plan on that thread (batch,
forward, sampling, per-slot state: core/step_runner.py). Its requests and steps (`add`,
`step`, `overlap_step`, `run`) are the `StepLoop` it extends (core/step_loop.py); what a
request brings besides tokens, grammars and images, waits in its `StepInputs`
(core/step_inputs.py); the start-up decisions (KV budget, graphs, warm-up, step cost) are
core/engine_start.py's. `__init__` builds the parts in the order they need each other.

HiCache (`--enable-hierarchical-cache`): `host` is the host KV tier beside `kv`, over the host
pool that the host-cache actor owns and opens for us (`hicache`, an `ActorLink`), and the
scheduler's prefix cache is the tiered one over both; backups run on the executor thread behind
the steps, a step's load-backs inside its forward, layer by layer (`core/hicache/`). `storage`
runs the L3 tier (with `--hicache-storage-backend`) and notices the actor's death. With several
ranks each holds a host pool of its own KV slice (the actor makes them all; rank 0 hands their
segment's name to the followers), and rank 0 hands each backup it runs to the followers
(`HostTier.mirror`); with L3 a backup ends when every rank's copy has (`HostTier.barrier`).

Tensor parallelism (`rank`, one engine process per rank): each rank builds its model shard, its
KV pool of its own KV heads and a StepRunner; the ranks agree on the smallest page count any
rank planned. Rank 0 schedules and sends each plan before it runs it (as its batch is built
ahead, when it is: core/step_loop.py); followers
(engine/ranks.py) build the same core, run no scheduler and `follow()` rank 0's plans through
the same StepRunner, which hands rank 0's sampled tokens to every rank (core/ranks.py), and
so rank 0's speculative drafts and verdicts and the image features only rank 0 encodes (the
plan says how many feature rows come: `StepInputs.keep`). Ranks run in lockstep, so with more
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
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from m3serve.backends import create_backend
from m3serve.core.engine_start import (
    capture_graphs,
    capture_heads,
    capture_piecewise,
    grammar_compiler,
    mixed_budget,
    plan_kv,
    storage_tier,
    warm_up,
)
from m3serve.core.executor import Executor, launches_ahead
from m3serve.core.hicache.storage_tier import ActorLink
from m3serve.core.hicache.tier import HostTier, rank_pool_opener
from m3serve.core.matchers import GrammarMatchers
from m3serve.core.memory import kv_cache_dtype, leave_a_core_for_the_scheduler
from m3serve.core.rank_join import agree_on_pages, join_ranks, leave_ranks, rank_device
from m3serve.core.ranks import LEADER, MediaShare, PlanChannel, TokenShare, follow
from m3serve.core.sampler import Sampler
from m3serve.core.scheduler import Scheduler
from m3serve.core.spec.engine import SpecPlugin
from m3serve.core.step_inputs import StepInputs, media_check
from m3serve.core.step_loop import StepLoop
from m3serve.core.step_runner import StepRunner
from m3serve.core.trace import StartupPhases, StepTrace
from m3serve.core.warmup import use_kernel_cache
from m3serve.core.warmup_record import Recorder
from m3serve.model.build import load_model, resolve_device
from m3serve.model.kv_cache import KVCache
from m3serve.model.parallel import Parallel, RankGroup
from m3serve.model.slot_pages import SlotPages
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import PageCopy, RankAddress, StepPlan
from m3serve.runtime.paths import cache_root

log = logging.getLogger(__name__)

# At shutdown, how long the last L3 writes may take to be handed to the host-cache actor.
FLUSH_S = 10.0
# The step number of a plan that only carries rank 0's HiCache backups to the followers.
BACKUP_STEP = -(2**31)


class EngineCore(StepLoop):
    def __init__(
        self,
        args: ServerArgs,
        model_path: Path | None,
        hicache: ActorLink | None = None,
        rank: RankAddress | None = None,
    ) -> None:
        """`hicache`: the host-cache actor, which HiCache needs on rank 0 (it owns the host
        pool; a follower rank attaches its part); `rank`: this process's place in a
        tensor-parallel group (None: one rank)."""
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
                args.backend.backend,
                self.device,
                args.kernel.moe_runner_backend,
                args.kernel.mxfp8_bf16_copy,
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
            useful = context * slots
            self.budget = plan_kv(
                args, self.model, self.device, self.ranks, kv_dtype, useful, self.spec
            )
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
            open_pools = hicache.open_pool if hicache is not None else None
            with self.startup.phase("host KV pool"):
                self.host = HostTier.create(
                    args.hicache,
                    cfg,
                    self.kv,
                    self.budget.num_pages,
                    rank_pool_opener(self.ranks, open_pools),
                    lambda job, what: self.executor.call(job, what),
                    draft=draft_kv,
                    ranks_on_host=self.ranks.size,
                    agree=lambda pages: agree_on_pages(self.ranks, pages, self.device),
                )
        # ------------------------------------------------------------------ grammars
        # Only rank 0 constrains: the followers take its tokens (core/ranks.py TokenShare).
        leader = self.ranks.rank == LEADER
        self.grammar = grammar_compiler(self.loaded, cfg.vocab_size) if leader else None
        self.inputs = StepInputs(self.grammar, media_check(self.loaded))
        # ------------------------------------------------------------------ the step runner
        self.runner = StepRunner(
            self.model,
            self.kv,
            self.budget.page_size,
            Sampler(slots, cfg.vocab_size, self.device),
            GrammarMatchers(cfg.vocab_size),
            self.inputs.step_grammars,
            self.host,
            self.inputs.step_media,
        )
        # Slot page lists on the device: the scheduler's rows carry only their changes. No
        # request holds more pages than the pool.
        self.runner.slot_pages = SlotPages(slots, self.budget.num_pages, self.device)
        if self.spec is not None:
            with self.startup.phase("DSpark draft"):
                self.spec.attach(self.runner, self.model, self.backend, self.budget, kv_dtype)
        self.plans: PlanChannel | None = None
        if self.ranks.size > 1:
            self.plans = PlanChannel(self.ranks)
            self.runner.share = TokenShare(self.ranks, self.device)
            hidden = cfg.hidden_size
            self.runner.media_share = MediaShare(self.ranks, self.device, hidden, self.model.dtype)
            if self.host is not None:
                l3 = args.hicache.hicache_storage_backend is not None
                self.host.spread_over(self.ranks, self._mirror_backup, l3)
        # ------------------------------------------------------------------ warm-up
        if self.device.type == "cuda" and not args.kernel.skip_warmup:
            with self.startup.phase("warm-up"):
                self._warm_up(args, context, slots)
        # ------------------------------------------------------------------ CUDA graphs
        with self.startup.phase("CUDA graphs"):
            # Speculative steps draw through their own path; a follower rank draws nothing.
            draw = self.runner.graph_draw() if self.spec is None and self.ranks.size == 1 else None
            self.runner.graphs = capture_graphs(
                args, self.backend, self.model, self.kv, self.budget, context, slots, draw
            )
            if self.spec is not None and self.runner.graphs is not None:
                graphs = self.runner.graphs
                pages = self.budget.num_pages  # the scratch page
                self.spec.capture_graphs(graphs.sizes, graphs.max_pages, pages, graphs.pool)
            self.runner.piecewise = capture_piecewise(
                args, self.backend, self.model, self.kv, self.budget, slots
            )
            self.runner.heads = capture_heads(self.model, self.runner, draw, slots)
        # ------------------------------------------------------------------ scheduler
        radix = not args.cache.disable_radix_cache
        self.served_budget = budget = mixed_budget(
            args,
            self.device,
            self.runner,
            self.budget,
            self.startup,
            slots,
            self.loaded.path,
        )
        pages = self.budget.num_pages
        cache = self.host.prefix_cache(pages, cfg.page_size) if self.host is not None else None
        self.storage = storage_tier(args, hicache, cache, self.host, self.loaded.path, self.spec)
        self.scheduler = Scheduler(
            args.sched,
            pages,
            cfg.page_size,
            radix,
            mixed_budget=budget,
            cache=cache,
            storage=self.storage,
            page_deltas=True,
            demand=budget.demand if budget is not None else None,
        )
        if self.spec is not None:
            self.scheduler.spec_draft = self.spec.settings.block_size
        # ------------------------------------------------------------------ executor
        hold = self.device.type != "cpu"  # launches are asynchronous
        ahead = launches_ahead(args.sched.launch_ahead, hold)
        self.executor = Executor(self.run, self.prepare, hold=hold, wait_for_plans=ahead)
        self.runner.while_device_runs = self.executor.while_device_runs
        self.runner.launch_ahead = ahead
        self._in_flight = None
        self._budget_rows = {}
        self._ready_compiles = self.trace.compiles.count
        if self.device.type == "cuda":
            device = self.device

            def allocations() -> tuple[int, int]:
                stats = torch.cuda.memory_stats(device)
                return stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0)

            self.trace.watch_allocator(allocations)
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

    def follow(self) -> int:
        """A follower rank's whole life after start: run rank 0's plans, in order, until it
        says stop; the number of plans run. Raises `RankLost` when another rank dies."""
        assert self.plans is not None and self.ranks.rank != LEADER
        return follow(self.plans, self._run_followed)

    def _run_followed(self, plan: StepPlan) -> None:
        """A follower's step; a kernel compiled in it is logged as on rank 0 (a compile after
        ready stalls every rank, since the others wait for this one at the next collective)."""
        before = self.trace.compiles.count
        self.runner.run(plan)
        compiled = self.trace.compiles.since(before)
        if compiled:
            log.warning(
                "rank %d: step %d compiled %d: %s (a compile stalls every request in the step)",
                self.ranks.rank,
                plan.step,
                len(compiled),
                ", ".join(compiled),
            )

    def _mirror_backup(self, copy: PageCopy) -> None:
        """Rank 0, on the executor thread: a HiCache backup it is about to run, to the
        followers (core/hicache/tier.py)."""
        assert self.plans is not None
        self.plans.send(StepPlan(step=BACKUP_STEP, seqs=[], backups=[copy]))

    def _warm_up(self, args: ServerArgs, context: int, slots: int) -> None:
        """Run every step shape class once (core/engine_start.py `warm_up`), then wait for the
        device, and note what it took."""
        compiles = self.trace.compiles
        before = compiles.count
        done = warm_up(
            args, self.runner, self.budget, self.spec, context, slots, self._recorder(args)
        )
        torch.cuda.synchronize(self.device)
        kernels = compiles.count - before
        ran = f"{done.steps} of {done.plans} plans" if done.recorded else f"{done.steps} steps"
        self.startup.note("warm-up", f"{ran} on layers {done.layers}, {kernels} kernels")

    def _recorder(self, args: ServerArgs) -> Recorder | None:
        """Where the warm-up notes the plans that load kernels, for the next start
        (core/warmup_record.py): on a GPU, with Triton to count the loads."""
        compiles = self.trace.compiles
        if self.device.type != "cuda" or not compiles.hooked:
            return None
        import triton

        props = torch.cuda.get_device_properties(self.device)
        # Not the scheduling section: the plans follow from the pass's limits, which hold what
        # it changes (slots, step tokens), and A/B runs of its budget knobs keep their record.
        sections = ("model", "backend", "cache", "parallel", "spec", "hicache")
        parts: dict[str, Any] = {name: getattr(args, name) for name in sections}
        parts["kernel"] = replace(args.kernel, full_warmup=False)
        parts["versions"] = {"triton": triton.__version__, "torch": torch.__version__}
        parts["device"] = (props.name, props.major, props.minor, props.multi_processor_count)
        parts["config"] = self.loaded.config
        parts["weights"] = (str(self.model.dtype), self.backend.name, self.backend.weight_formats)
        return Recorder(cache_root() / "warmup", parts, lambda: compiles.count, self.ranks)

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
