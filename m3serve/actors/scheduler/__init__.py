"""The engine process's brain: continuous batching, admission, chunked prefill, retraction,
prefix caching and the overlap loop that keeps the executor busy."""
