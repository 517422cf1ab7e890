"""The garbage collector of a process that m3serve owns, once it has started.

A full collection walks every tracked object: in an engine process that is the model's modules,
the CUDA graphs' bookkeeping and the warm-up's leftovers, hundreds of thousands of objects, and
a pass over them stops the event loop (and with it every stream) for milliseconds at a time.
What exists when start-up ends lives as long as the process, so it is moved out of the
collector's sight (`gc.freeze`, as SGLang and vLLM do after start-up); objects made while
serving are collected as before. Only for processes m3serve owns: in an embedding process the
caller's objects are not ours to pin. At exit the heap is thawed again, so that the interpreter's
last collections free what start-up built (frozen, the extension types of Triton and xgrammar
outlived the interpreter, and nanobind printed hundreds of "leaked" lines at every shutdown).
"""

from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger(__name__)


def freeze_heap(name: str) -> int:
    """Collect what start-up left behind, then keep the survivors out of later collections;
    the number of objects kept out."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often a process freezes
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.debug("%s: %d objects left out of garbage collection", name, frozen)
    return frozen
