"""The compile keys of Triton launches that run in Triton's interpreter.

On a GPU, Triton compiles one binary per distinct key of a kernel: its constexpr values, the
launch options (warps, stages), and for every other argument its type plus the value classes it
specializes on (an int equal to 1 or divisible by 16, a pointer aligned to 16 bytes) unless the
argument is in `do_not_specialize`. The interpreter compiles nothing, so this recorder computes
the same keys with Triton's own specialization function: a CPU test can then prove that a
warm-up pass launched every variant that later traffic needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import native_specialize_impl

Key = tuple[Any, ...]


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def _arg_class(value: Any, specialize: bool) -> Any:
    if value is None or isinstance(value, str):
        return value
    if hasattr(value, "data_ptr") or isinstance(value, (bool, int, float)):
        return native_specialize_impl(BaseBackend, value, False, specialize, True)
    return str(value)


def launch_key(fn: InterpretedFunction, args: tuple, kwargs: dict[str, Any]) -> Key:
    """The key the compiler would specialize this launch on."""
    signature = inspect.signature(fn.fn)
    params = signature.parameters
    options = {k: v for k, v in kwargs.items() if k not in params}
    bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    unspecialized = set(fn.kwargs.get("do_not_specialize") or ())
    parts = []
    for name, value in bound.arguments.items():
        if _is_constexpr(params[name]):
            parts.append((name, str(value)))
        else:
            parts.append((name, _arg_class(value, name not in unspecialized)))
    return (fn.fn.__name__, tuple(parts), tuple(sorted(options.items())))


@contextmanager
def recording(execute: bool = True) -> Iterator[set[Key]]:
    """Collect the key of every interpreted launch made inside the block. With `execute`
    False the kernels are not run (their outputs stay as allocated): launch decisions depend on
    shapes only, so the keys are the same and a forward costs only its host work."""
    keys: set[Key] = set()
    original = InterpretedFunction.run

    def run(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        keys.add(launch_key(self, args, kwargs))
        if not execute:
            return None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield keys
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]


def describe(keys: set[Key]) -> str:
    """One line per key, for assertion messages."""
    return "\n".join(sorted(f"{name} {dict(parts)} {dict(opts)}" for name, parts, opts in keys))
