"""The OpenAI-compatible HTTP API process: routes, streaming, metrics."""
