"""What `AsyncEngine` does when an actor reports an error or its process dies: a request error
goes to its stream, a crashed tokenizer worker fails only its own requests and is started again,
and anything else kills the engine (every pending request fails with `EngineDeadError`)."""

from __future__ import annotations

import asyncio
import logging

from m3serve.engine.errors import EngineDeadError, RequestError
from m3serve.engine.hicache import HICACHE
from m3serve.engine.plumbing import RequestPlumbing
from m3serve.engine.ranks import is_engine_rank
from m3serve.engine.workers import worker_index
from m3serve.runtime.messages import (
    Abort,
    DetokenizeResult,
    Error,
    Ready,
    TextBatch,
    TokenizeResult,
)
from m3serve.runtime.transport import Inbox, MailboxClosed

log = logging.getLogger(__name__)


class Recovery(RequestPlumbing):
    """Routes what the actors send back, and survives the failures that can be survived."""

    async def _read(self, inbox: Inbox) -> None:
        """Route what the actors send back (outputs, request errors, crash reports)."""
        while True:
            try:
                message = await inbox.recv()
            except MailboxClosed:
                return
            if isinstance(message, TextBatch):
                self._deliver(message)
            elif isinstance(message, (TokenizeResult, DetokenizeResult)):
                self._answer(message.rid, message)
            elif isinstance(message, Error):
                self._deliver_error(message)
            elif isinstance(message, Ready):
                self._on_ready(message)

    def _deliver_error(self, error: Error) -> None:
        if error.rid is None:
            if error.actor == HICACHE:
                log.error("%s; the engine continues with HiCache disabled", error.message)
            elif self._restartable(error.actor):
                # Its process exits next; the supervisor's notice of that starts it again.
                log.error("%s", error.message)
            else:
                self._die(EngineDeadError(error.message))
            return
        state = self._streams.get(error.rid)
        if state is not None:
            state.queue.put_nowait(RequestError(error.message, error.code))
        self._answer(error.rid, RequestError(error.message, error.code))

    def _on_death(self, name: str, exitcode: int | None) -> None:
        message = f"the {name} process exited unexpectedly (exit code {exitcode})"
        if name == HICACHE:
            # The engine notices this itself, fails what waited on it and goes on without it.
            log.error("%s; the engine continues with HiCache disabled", message)
            return
        worker = worker_index(name)
        if worker is not None and self._restartable(name):
            self._restart_worker(worker, name, message)
            return
        if self._graph is not None:
            self._graph.forget_metrics_of(name)
            if is_engine_rank(name):
                self._graph.stop_engine_ranks()
        self._die(EngineDeadError(message))

    def _restartable(self, actor: str | None) -> bool:
        """A tokenizer worker in its own process can be started again; the engine cannot (its
        requests' KV and state are gone with it), nor can an in-process actor."""
        return (
            actor is not None
            and worker_index(actor) is not None
            and not self.args.runtime.single_process
        )

    def _restart_worker(self, worker: int, name: str, message: str) -> None:
        """Fail the dead worker's requests (their detokenizer state died with it), tell the
        scheduler to stop them, and start the worker again."""
        assert self._graph is not None and self.workers is not None
        log.error("%s", message)
        may_restart = self.workers.died(worker)
        lost = [rid for rid, state in self._streams.items() if state.worker == worker]
        for rid in lost:
            self._streams[rid].queue.put_nowait(
                RequestError(f"{message}; the request was lost, send it again", 503)
            )
        if lost:
            self._tasks.append(asyncio.create_task(self._abort_lost(lost)))
        for rid in [r for r, w in self._call_workers.items() if w == worker]:
            self._answer(rid, RequestError(f"{message}; send the request again", 503))
        if not may_restart:
            self._die(EngineDeadError(f"{message}; tokenizer workers keep dying, not restarted"))
            return
        self._graph.supervisor.respawn(name)
        timeout = self.args.runtime.startup_timeout
        old = self._restart_timers.pop(worker, None)
        if old is not None:
            old.cancel()
        self._restart_timers[worker] = asyncio.get_running_loop().call_later(
            timeout, self._restart_timed_out, worker, timeout
        )

    async def _abort_lost(self, rids: list[str]) -> None:
        assert self._graph is not None
        for rid in rids:
            await self._graph.scheduler.send(Abort(rid))

    def _restart_timed_out(self, worker: int, timeout: float) -> None:
        assert self.workers is not None
        if worker in self.workers.down:
            self._die(
                EngineDeadError(f"tokenizer{worker} was not ready {timeout:g}s after a restart")
            )

    def _on_ready(self, ready: Ready) -> None:
        worker = worker_index(ready.actor)
        if worker is None or self.workers is None or not self.workers.ready(worker):
            return
        timer = self._restart_timers.pop(worker, None)
        if timer is not None:
            timer.cancel()
        log.info("tokenizer%d is serving again (pid %d)", worker, ready.pid)

    def _die(self, error: EngineDeadError) -> None:
        if self.dead is None:
            log.error("%s", error)
            self.dead = error
        self.healthy = False
        self.died.set()
        self._fail_all(error)
