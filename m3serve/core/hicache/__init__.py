"""HiCache, the engine's side: the host KV tier under the prefix cache, the keys its pages are
stored under in L3 (`keys`), and the client of the host-cache actor that owns the host pool and
the L3 storage (`storage_client`)."""
