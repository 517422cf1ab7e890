"""Entry points of the actor processes and the addresses that wire them together.

Children are started with the `spawn` method: each imports what it needs, connects its
mailboxes, serves until Shutdown, and exits on its own if the parent process dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3serve.runtime.codec import Codec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import ToApi, ToScheduler, ToSupervisor, ToTokenizer
from m3serve.runtime.transport import ZmqInbox, ZmqOutbox, ipc_address

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class Addresses:
    api: str
    control: str
    scheduler: str
    tokenizers: tuple[str, ...]

    @classmethod
    def under(cls, run_dir: Path, workers: int) -> Addresses:
        return cls(
            api=ipc_address(run_dir, "api"),
            control=ipc_address(run_dir, "ctl"),
            scheduler=ipc_address(run_dir, "sched"),
            tokenizers=tuple(ipc_address(run_dir, f"tok{i}") for i in range(workers)),
        )


def engine_process(
    addresses: Addresses, model_path: Path, args: ServerArgs, log_level: int
) -> None:
    from m3serve.actors.scheduler.actor import SchedulerActor

    async def main() -> None:
        actor = SchedulerActor(
            ZmqInbox(addresses.scheduler, Codec(ToScheduler)),
            [ZmqOutbox(a, Codec(ToTokenizer)) for a in addresses.tokenizers],
            ZmqOutbox(addresses.control, Codec(ToSupervisor)),
            args,
            model_path,
        )
        await actor.serve()

    _run("engine", main(), log_level)


def tokenizer_process(
    addresses: Addresses,
    worker: int,
    model_path: Path,
    args: ServerArgs,
    session: str,
    log_level: int,
) -> None:
    from m3serve.actors.tokenizer import TokenizerActor

    async def main() -> None:
        actor = TokenizerActor(
            ZmqInbox(addresses.tokenizers[worker], Codec(ToTokenizer)),
            scheduler=ZmqOutbox(addresses.scheduler, Codec(ToScheduler)),
            api=ZmqOutbox(addresses.api, Codec(ToApi)),
            control=ZmqOutbox(addresses.control, Codec(ToSupervisor)),
            model_dir=model_path,
            worker=worker,
            session=session,
            skip_tokenizer_init=args.runtime.skip_tokenizer_init,
            context_length=args.runtime.context_length,
        )
        await actor.serve()

    _run(f"tokenizer{worker}", main(), log_level)


def _run(name: str, main: Coroutine[Any, Any, None], log_level: int) -> None:
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s"
    )
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
