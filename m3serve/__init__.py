"""m3serve: a production LLM server for MiniMax-M3.1-Flash.

The library surface lives here; everything else is an implementation detail.
"""

__version__ = "0.1.0"
