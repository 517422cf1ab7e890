"""HiCache, the engine's side: the host KV pool (L2, shared memory), device<->host page copies
and the tiered prefix cache that decides them; the keys pages are stored under in L3 (`keys`)
and the client of the host-cache actor that owns the L3 storage (`storage_client`)."""
