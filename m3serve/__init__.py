"""m3serve: a production LLM server for MiniMax-M3.1-Flash.

The library surface: `Engine` (SGLang-style offline engine), `AsyncEngine` (inside an event
loop), `SamplingParams`.
"""

from m3serve.runtime.engine import AsyncEngine, EngineDeadError, RequestError
from m3serve.runtime.messages import SamplingParams
from m3serve.runtime.offline import Engine

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineDeadError",
    "RequestError",
    "SamplingParams",
    "__version__",
]
