"""Starting the actor graph: the tokenizer workers, the engine process's scheduler actor and,
with --enable-hierarchical-cache, the host-cache actor (engine/hicache.py), either as spawned
processes talking over ZeroMQ or as tasks in the caller's event loop over in-process mailboxes.
Both give the caller the same `ActorGraph`.

With --tp N the engine is N processes: the engine process is rank 0, and ranks 1..N-1 are
follower processes (engine/ranks.py) that join its rank group and report Ready like any actor.

Children are started with the `spawn` method: each imports what it needs (a tokenizer worker
never imports torch), connects its mailboxes, serves until Shutdown, and exits on its own if the
parent process dies.

The graph also says where the engine's Prometheus metrics (`EngineMetrics`) can be read. In
process mode the engine process writes them through prometheus_client's multiprocess mode into
`<run dir>/metrics`, and the graph holds a registry around a `MultiProcessCollector` over those
files; in-process, it holds the scheduler actor's own registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3serve.actors.preprocess_threads import bound_worker_threads
from m3serve.engine.hicache import (
    HICACHE,
    hicache_actor,
    hicache_client,
    hicache_in_process,
    wants_hicache,
)
from m3serve.engine.ranks import follower_name, is_engine_rank, rank_addresses, serve_follower
from m3serve.runtime.actor import Actor
from m3serve.runtime.codec import Codec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import (
    Error,
    FromHiCache,
    RankAddress,
    Ready,
    Shutdown,
    ToApi,
    ToHiCache,
    ToScheduler,
    ToSupervisor,
    ToTokenizer,
)
from m3serve.runtime.supervisor import StartupError, Supervisor
from m3serve.runtime.transport import (
    Inbox,
    InProcChannel,
    Outbox,
    ZmqInbox,
    ZmqOutbox,
    ipc_address,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from m3serve.actors.tokenizer import TokenizerActor

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


@dataclass
class ActorGraph:
    """The running actors, as the process that started them sees them."""

    tokenizers: list[Outbox]  # a request goes to the worker that owns its rid
    scheduler: Outbox
    outputs: Inbox  # TextBatch and per-request Error from the tokenizer workers
    control: Inbox  # Ready and Error from every actor
    ready: dict[str, Ready]
    supervisor: Supervisor
    metrics: CollectorRegistry  # the engine's metrics, as this process can read them
    # In-process mode: the actors and their serve() tasks (tests and embedded uses look inside).
    actors: list[Actor] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closables: list[Inbox | Outbox] = field(default_factory=list)
    hicache: Outbox | None = None  # the host-cache actor, with --enable-hierarchical-cache

    async def shutdown(self) -> None:
        """Ask every actor to stop, wait for them, and release every process and mailbox."""
        await _send_shutdown([*self.tokenizers, self.scheduler])
        if self.hicache is not None:
            # Only after the engine: its last Backups still reach storage, and it never sees
            # the host cache go away first.
            await self._engine_stopped(timeout=30)
            await _send_shutdown([self.hicache])
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=30)
        await self.supervisor.shutdown()
        for box in self.closables:
            box.close()

    async def _engine_stopped(self, timeout: float) -> None:
        engine = [t for t in self.tasks if t.get_name() == "scheduler"]
        if engine:
            await asyncio.wait(engine, timeout=timeout)
        elif (proc := self.supervisor.procs.get("engine")) is not None:
            self.supervisor.stop_watching()  # the exits that follow are the shutdown's
            await asyncio.to_thread(proc.join, timeout)

    def stop_engine_ranks(self) -> None:
        """Terminate the engine's processes still alive once one of its ranks is lost: the
        others can run no step without it, and an idle rank 0 would not even notice (only a
        collective fails), holding its device memory until the server stops."""
        for name, proc in self.supervisor.procs.items():
            if is_engine_rank(name) and proc.is_alive():
                log.warning("terminating %s (pid %s): its engine lost a rank", name, proc.pid)
                proc.terminate()

    def forget_metrics_of(self, name: str) -> None:
        """Drops the live gauges of a child that died: a dead engine runs and holds nothing.
        Its counters stay, as Prometheus counters do."""
        proc = self.supervisor.procs.get(name)
        if proc is None or proc.pid is None:
            return  # in-process actors write no files
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(proc.pid, str(metrics_dir(self.supervisor)))


async def _send_shutdown(outboxes: list[Outbox]) -> None:
    for outbox in outboxes:
        # A dead peer's mailbox may refuse; the supervisor handles the rest.
        with contextlib.suppress(Exception):
            await outbox.send(Shutdown())


def metrics_dir(supervisor: Supervisor) -> Path:
    """Where the engine process of a process-mode graph writes its metric files (removed with
    the run dir at shutdown)."""
    return supervisor.run_dir / "metrics"


@dataclass(frozen=True)
class Addresses:
    api: str
    control: str
    scheduler: str
    tokenizers: tuple[str, ...]
    hicache: str | None = None  # the host-cache actor's inbox
    hicache_replies: str | None = None  # the engine's inbox for its replies

    @classmethod
    def under(cls, run_dir: Path, workers: int, hicache: bool = False) -> Addresses:
        return cls(
            api=ipc_address(run_dir, "api"),
            control=ipc_address(run_dir, "ctl"),
            scheduler=ipc_address(run_dir, "sched"),
            tokenizers=tuple(ipc_address(run_dir, f"tok{i}") for i in range(workers)),
            hicache=ipc_address(run_dir, "hc") if hicache else None,
            hicache_replies=ipc_address(run_dir, "hc-reply") if hicache else None,
        )


async def start_processes(args: ServerArgs, model_path: Path, supervisor: Supervisor) -> ActorGraph:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    workers = args.runtime.tokenizer_worker_num
    addresses = Addresses.under(supervisor.run_dir, workers, hicache=wants_hicache(args))
    outputs = ZmqInbox(addresses.api, Codec(ToApi))
    control = ZmqInbox(addresses.control, Codec(ToSupervisor))
    tokenizers = [ZmqOutbox(a, Codec(ToTokenizer)) for a in addresses.tokenizers]
    scheduler = ZmqOutbox(addresses.scheduler, Codec(ToScheduler))
    level = logging.getLogger().getEffectiveLevel()
    session = supervisor.session
    metric_files = metrics_dir(supervisor)
    metric_files.mkdir()
    metrics = CollectorRegistry()
    MultiProcessCollector(metrics, path=str(metric_files))
    hicache: ZmqOutbox | None = None
    if addresses.hicache is not None:
        supervisor.spawn(HICACHE, hicache_process, addresses, args, session, level)
        hicache = ZmqOutbox(addresses.hicache, Codec(ToHiCache))
    _spawn_engine(supervisor, addresses, model_path, args, level, metric_files)
    for i in range(workers):
        supervisor.spawn(
            f"tokenizer{i}", tokenizer_process, addresses, i, model_path, args, session, level
        )
    graph = ActorGraph(
        tokenizers,
        scheduler,
        outputs,
        control,
        {},
        supervisor,
        metrics,
        closables=[outputs, control, *tokenizers, scheduler, *([hicache] if hicache else [])],
        hicache=hicache,
    )
    try:
        graph.ready = await supervisor.wait_ready(control, args.runtime.startup_timeout)
    except BaseException:
        await graph.shutdown()
        raise
    return graph


def _spawn_engine(
    supervisor: Supervisor,
    addresses: Addresses,
    model_path: Path,
    args: ServerArgs,
    level: int,
    metric_files: Path,
) -> None:
    """The engine process, and with --tp N the follower ranks beside it."""
    tp = args.parallel.tp_size
    ranks: list[RankAddress | None] = [*rank_addresses(tp)] if tp > 1 else [None]
    engine = (addresses, model_path, args, level, metric_files, ranks[0])
    supervisor.spawn("engine", engine_process, *engine)
    for rank in ranks[1:]:
        assert rank is not None
        follower = (addresses.control, model_path, args, level, rank)
        supervisor.spawn(follower_name(rank.rank), follower_process, *follower)


async def start_in_process(
    args: ServerArgs, model_path: Path, supervisor: Supervisor
) -> ActorGraph:
    from m3serve.actors.scheduler import SchedulerActor

    workers = args.runtime.tokenizer_worker_num
    outputs, control, scheduler = InProcChannel(), InProcChannel(), InProcChannel()
    tokenizers = [InProcChannel() for _ in range(workers)]
    hicache = None
    if wants_hicache(args):
        hicache = await hicache_in_process(args, supervisor.session, control.outbox())
    engine = SchedulerActor(
        scheduler.inbox(),
        [t.outbox() for t in tokenizers],
        control.outbox(),
        args,
        model_path,
        hicache=hicache.client if hicache else None,
    )
    actors: list[Actor] = [engine, *([hicache.actor] if hicache else [])]
    for i, channel in enumerate(tokenizers):
        actors.append(
            _tokenizer_actor(
                args,
                model_path,
                i,
                channel.inbox(),
                scheduler.outbox(),
                outputs.outbox(),
                control.outbox(),
                supervisor.session,
            )
        )
    graph = ActorGraph(
        [t.outbox() for t in tokenizers],
        scheduler.outbox(),
        outputs.inbox(),
        control.inbox(),
        {},
        supervisor,
        engine.metrics.registry,
        actors=actors,
        tasks=[asyncio.create_task(a.serve(), name=a.name) for a in actors],
        hicache=hicache.to_actor if hicache else None,
    )
    try:
        while len(graph.ready) < len(actors):
            message = await asyncio.wait_for(graph.control.recv(), args.runtime.startup_timeout)
            if isinstance(message, Error):
                raise StartupError(message.message)
            graph.ready[message.actor] = message
    except BaseException:
        await graph.shutdown()
        raise
    return graph


def _tokenizer_actor(
    args: ServerArgs,
    model_path: Path,
    worker: int,
    inbox: Inbox,
    scheduler: Outbox,
    outputs: Outbox,
    control: Outbox,
    session: str,
) -> TokenizerActor:
    from m3serve.actors.tokenizer import TokenizerActor

    return TokenizerActor(
        inbox,
        scheduler=scheduler,
        api=outputs,
        control=control,
        model_dir=model_path,
        worker=worker,
        session=session,
        skip_tokenizer_init=args.runtime.skip_tokenizer_init,
        context_length=args.runtime.context_length,
        max_prompt_chars=args.runtime.max_prompt_chars,
        max_image_pixels=args.media.max_image_pixels,
    )


# ---------------------------------------------------------------------- process entry points


def engine_process(
    addresses: Addresses,
    model_path: Path,
    args: ServerArgs,
    log_level: int,
    metric_files: Path,
    rank: RankAddress | None = None,
) -> None:
    _write_metrics_to(metric_files)
    from m3serve.actors.scheduler import SchedulerActor

    async def main() -> None:
        hicache = None
        if addresses.hicache is not None and addresses.hicache_replies is not None:
            hicache = hicache_client(addresses.hicache, addresses.hicache_replies)
        actor = SchedulerActor(
            ZmqInbox(addresses.scheduler, Codec(ToScheduler)),
            [ZmqOutbox(a, Codec(ToTokenizer)) for a in addresses.tokenizers],
            ZmqOutbox(addresses.control, Codec(ToSupervisor)),
            args,
            model_path,
            hicache=hicache,
            rank=rank,
        )
        await actor.serve(own_process=True)

    _run("engine", main(), log_level)


def follower_process(
    control: str, model_path: Path, args: ServerArgs, log_level: int, rank: RankAddress
) -> None:
    """Rank 1..N-1 of a --tp N engine (engine/ranks.py)."""
    _run(follower_name(rank.rank), serve_follower(control, model_path, args, rank), log_level)


def hicache_process(addresses: Addresses, args: ServerArgs, session: str, log_level: int) -> None:
    assert addresses.hicache is not None and addresses.hicache_replies is not None

    async def main() -> None:
        actor = await hicache_actor(
            args,
            session,
            ZmqInbox(addresses.hicache, Codec(ToHiCache)),
            ZmqOutbox(addresses.hicache_replies, Codec(FromHiCache)),
            ZmqOutbox(addresses.control, Codec(ToSupervisor)),
        )
        await actor.serve(own_process=True)

    _run(HICACHE, main(), log_level)


def tokenizer_process(
    addresses: Addresses,
    worker: int,
    model_path: Path,
    args: ServerArgs,
    session: str,
    log_level: int,
) -> None:
    # Its own process: the torch pool is this worker's share of the cores, not all of them.
    bound_worker_threads(args.runtime.tokenizer_worker_num)

    async def main() -> None:
        actor = _tokenizer_actor(
            args,
            model_path,
            worker,
            ZmqInbox(addresses.tokenizers[worker], Codec(ToTokenizer)),
            ZmqOutbox(addresses.scheduler, Codec(ToScheduler)),
            ZmqOutbox(addresses.api, Codec(ToApi)),
            ZmqOutbox(addresses.control, Codec(ToSupervisor)),
            session,
        )
        await actor.serve(own_process=True)

    _run(f"tokenizer{worker}", main(), log_level)


def _write_metrics_to(directory: Path) -> None:
    """Puts prometheus_client in multiprocess mode for this (engine) process: every metric made
    from here on keeps its value in an mmap file under `directory`, where the API process's
    `MultiProcessCollector` reads it. Only ever called in a spawned child."""
    imported = "prometheus_client" in sys.modules
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    if imported:
        # prometheus_client picks its value class when first imported, and a spawned child
        # re-imports the parent's __main__ before running this: a script that imports
        # prometheus_client at top level made that choice already, without the directory.
        from prometheus_client import values

        values.ValueClass = values.get_value_class()


def _run(name: str, main: Coroutine[Any, Any, None], log_level: int) -> None:
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s"
    )
    # Ctrl-C in a terminal signals the whole process group. A child stops when its parent says
    # so (Shutdown) or dies, so it ignores the signal instead of dying with a traceback while
    # the parent still drains its requests (the supervisor already starts it so, where it can).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)


def _exit_with_parent() -> None:
    """A child whose parent died (even by SIGKILL) must not linger."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
