"""HiCache inside the engine: the host KV pool (L2, shared memory), device<->host page copies,
and the tiered prefix cache that decides them. The L3 storage tier lives in the HiCache actor."""
