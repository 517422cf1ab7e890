"""Speculative decoding: verification rules, draft KV, proposal/verify step glue."""
