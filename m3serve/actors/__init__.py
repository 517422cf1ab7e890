"""The actors: message I/O around the work. `TokenizerActor` (chat template, tokenize,
incremental detokenize; N worker processes) and `SchedulerActor` (the engine process's loop
around its `EngineCore`)."""
