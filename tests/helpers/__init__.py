"""Test-only helpers shared across test directories (tests/ is on sys.path via pytest config)."""
