"""The engine as its callers hold it: `AsyncEngine` inside an event loop (the API server),
`Engine` for library users (sync calls, `async_*` from any loop, SGLang's result dicts), and the
wiring that starts the actor graph behind both."""

from m3serve.engine.async_engine import AsyncEngine
from m3serve.engine.errors import EngineDeadError, RequestError
from m3serve.engine.offline import Engine

__all__ = ["AsyncEngine", "Engine", "EngineDeadError", "RequestError"]
