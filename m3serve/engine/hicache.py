"""The host-cache actor's place in the actor graph: whether it runs, how it is built (in its own
process or in this one), and the engine's `StorageClient` of it.

It runs with --enable-hierarchical-cache. In process mode the supervisor spawns it before the
engine (launch.py's `hicache_process`); it reports `Ready` at once and makes the host pool when
the engine, knowing its KV plan, sends `HostPoolSpec` through its client. Its death is not the
engine's: the engine carries on with HiCache disabled (recovery.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from m3serve.actors.hicache import HiCacheActor
from m3serve.actors.hicache.storage import open_storage
from m3serve.core.hicache.storage_client import StorageClient
from m3serve.runtime.codec import Codec
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import FromHiCache, ToHiCache
from m3serve.runtime.transport import Inbox, InProcChannel, Outbox, ZmqInbox, ZmqOutbox

HICACHE = HiCacheActor.name  # the actor's name, and its process's


def wants_hicache(args: ServerArgs) -> bool:
    return args.hicache.enable_hierarchical_cache


async def hicache_actor(
    args: ServerArgs, session: str, inbox: Inbox, engine: Outbox, control: Outbox
) -> HiCacheActor:
    # Opening the store may sweep a large directory: not on the event loop.
    storage = await asyncio.to_thread(open_storage, args.hicache)
    return HiCacheActor(inbox, engine, control, session, storage)


def hicache_client(address: str, replies: str) -> StorageClient:
    """The engine process's client of a host-cache actor in its own process."""
    return StorageClient(
        ZmqOutbox(address, Codec(ToHiCache)), ZmqInbox(replies, Codec(FromHiCache))
    )


@dataclass
class InProcessHiCache:
    actor: HiCacheActor
    client: StorageClient  # the engine's
    to_actor: Outbox  # the graph's, for Shutdown


async def hicache_in_process(args: ServerArgs, session: str, control: Outbox) -> InProcessHiCache:
    """The actor and the engine's client over in-process mailboxes (--single-process)."""
    requests: InProcChannel[ToHiCache] = InProcChannel()
    replies: InProcChannel[FromHiCache] = InProcChannel()
    actor = await hicache_actor(args, session, requests.inbox(), replies.outbox(), control)
    return InProcessHiCache(
        actor, StorageClient(requests.outbox(), replies.inbox()), requests.outbox()
    )
