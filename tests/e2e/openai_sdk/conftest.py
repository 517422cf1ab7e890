"""The live server the openai SDK tests share: one `m3serve serve` for the whole directory (real
uvicorn, the multi-process engine, API key, both MiniMax parsers and a 64 KiB body limit, on the
tiny random checkpoint), an SDK client and a plain httpx client with the key.

The tiny model writes gibberish, so tests pin down shapes, types, usage arithmetic and
stream/non-stream agreement at temperature 0 — never meaning.
"""

from __future__ import annotations

from helpers.sdk_server import sdk_fixtures

server, client, http = sdk_fixtures("package")
