"""Actors: tokenizer, scheduler, KV-cache metadata, executor, host cache, draft."""
