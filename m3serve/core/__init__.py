"""The engine core: what the engine process holds and how it steps — `EngineCore` (model,
KV pools, sampler, CUDA graphs, scheduler, executor thread), the scheduling policy and its
request type, and the KV-cache bookkeeping (pages, slots, the radix prefix tree)."""
