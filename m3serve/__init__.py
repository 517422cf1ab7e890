"""m3serve: a production LLM server for MiniMax-M3.1-Flash.

The library surface: `Engine` (SGLang-style offline engine), `AsyncEngine` (inside an event
loop), `SamplingParams`, and `RequestOutput` (what `AsyncEngine.stream` yields).
"""

from m3serve.engine import AsyncEngine, Engine, EngineDeadError, RequestError
from m3serve.runtime.messages import RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineDeadError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
