"""The host-cache actor (its own process): the host KV pool in shared memory and the L3 storage
tier under it. `HiCacheActor` (actor.py), `HostPool` (pool.py), the `StorageBackend` interface
(storage.py) and its local-file backend (file_storage.py)."""

from m3serve.actors.hicache.actor import HiCacheActor

__all__ = ["HiCacheActor"]
