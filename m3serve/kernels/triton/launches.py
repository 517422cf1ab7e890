"""A layer's attention launches, repeated for the next layers of the same step.

Every layer of a step attends over the same batch: the same requests, lengths and page tables,
so the same kernel variants, grids and scratch buffers, with only the layer's own tensors (its
queries, KV cache, selected blocks and output) changed. Launched through Triton each time, the
four kernels of a sparse layer's eager attention cost ~0.45 ms of host time on the H100 machine
(Triton binding and specializing ~40 arguments a kernel, the wrappers' checks, tile sizing and
scratch allocations): 1.8 ms of a 4-layer mixed step's 2.5 ms launch, and so ~27 ms of a
60-layer one.

`LayerCalls.run` records the launches of the first layer's call (each goes through `launch`)
and, for the layers after it, launches the compiled kernels again directly with that layer's
tensors swapped in. A recorded call may do other device work only on what stays the same for
the step (its batch), since a replay repeats just the kernels; each per-layer input must reach
a kernel as itself, not as a view or a copy (checked when recording: otherwise the call is not
replayed); and a replay takes only tensors of the recorded dtype, shape, strides and pointer
alignment, which is what the compiled variant and the host-side sizes were computed for.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

R = TypeVar("R")

_local = threading.local()  # .launches: the list a call being recorded appends to


def launch(fn: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`fn[grid](*args, **kwargs)`; noted for replay while `recording` on this thread."""
    compiled = fn[grid](*args, **kwargs)
    launches: list[Launch] | None = getattr(_local, "launches", None)
    if launches is not None:
        launches.append(Launch.of(fn, grid, args, kwargs, compiled))


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """The launches made through `launch` on this thread inside the block."""
    outer = getattr(_local, "launches", None)
    _local.launches = launches = []
    try:
        yield launches
    finally:
        _local.launches = outer


_SIGNATURES: dict[Any, tuple[tuple[str, ...], dict[str, Any]]] = {}


def _signature(fn: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A kernel's parameter names in order, and the defaults of those that have one."""
    found = _SIGNATURES.get(fn)
    if found is None:
        params = inspect.signature(fn.fn).parameters.values()
        names = tuple(p.name for p in params)
        defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        found = _SIGNATURES[fn] = (names, defaults)
    return found


@dataclass
class Launch:
    """One kernel launch: every kernel parameter's value in order, and how to launch again."""

    fn: Any  # the @triton.jit function
    grid: tuple[int, int, int]
    values: list[Any]
    options: dict[str, Any]  # num_warps, num_stages, ...: Triton's, not the kernel's
    compiled: Any  # the compiled kernel; None in Triton's interpreter

    @classmethod
    def of(
        cls,
        fn: Any,
        grid: tuple[int, ...],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        compiled: Any,
    ) -> Launch:
        names, defaults = _signature(fn)
        values = list(args)
        for name in names[len(args) :]:
            values.append(kwargs[name] if name in kwargs else defaults[name])
        options = {k: v for k, v in kwargs.items() if k not in names}
        grid3 = (*grid, 1, 1)[:3]
        # A compiled kernel takes every parameter's value positionally, constexprs included.
        direct = compiled if hasattr(compiled, "packed_metadata") else None
        return cls(fn, grid3, values, options, direct)  # type: ignore[arg-type]

    def again(self, values: list[Any]) -> None:
        if self.compiled is not None:
            self.compiled[self.grid](*values)
        else:
            self.fn[self.grid](*values, **self.options)


def _form(t: torch.Tensor) -> tuple[Any, ...]:
    """What a compiled variant and the host-side sizes of a call depend on in a tensor."""
    return (t.device, t.dtype, t.shape, t.stride(), t.data_ptr() % 16 == 0)


def _position(inputs: Sequence[torch.Tensor], value: Any) -> int | None:
    for i, t in enumerate(inputs):
        if value is t:
            return i
    return None


@dataclass
class Recorded:
    """A call's launches, where each per-layer input goes in them, and what the call returned."""

    launches: list[Launch]
    slots: list[list[tuple[int, int]]]  # per launch: (parameter position, input index)
    forms: list[tuple[Any, ...]]
    result: Any
    result_input: int | None  # the result is this input (swapped on replay), else `result`

    @classmethod
    def make(
        cls, launches: list[Launch], inputs: Sequence[torch.Tensor], result: Any
    ) -> Recorded | None:
        """The recorded call, or None where it cannot be replayed: no launches, an input that
        reached no kernel, or a kernel argument that shares an input's memory without being
        that input (a view: its swap would be missed)."""
        if not launches:
            return None
        memory = {t.untyped_storage().data_ptr() for t in inputs}
        used: set[int] = set()
        slots = []
        for one in launches:
            mine = []
            for pos, value in enumerate(one.values):
                if not isinstance(value, torch.Tensor):
                    continue
                i = _position(inputs, value)
                if i is not None:
                    mine.append((pos, i))
                    used.add(i)
                elif value.untyped_storage().data_ptr() in memory:
                    return None
            slots.append(mine)
        if len(used) != len(inputs):
            return None
        result_input = _position(inputs, result)
        if (
            result_input is None
            and isinstance(result, torch.Tensor)
            and result.untyped_storage().data_ptr() in memory
        ):
            return None
        return cls(launches, slots, [_form(t) for t in inputs], result, result_input)

    def fits(self, inputs: Sequence[torch.Tensor]) -> bool:
        return len(inputs) == len(self.forms) and all(
            _form(t) == form for t, form in zip(inputs, self.forms, strict=True)
        )

    def replay(self, inputs: Sequence[torch.Tensor]) -> Any:
        for one, mine in zip(self.launches, self.slots, strict=True):
            values = one.values
            if mine:
                values = values.copy()
                for pos, i in mine:
                    values[pos] = inputs[i]
            one.again(values)
        return self.result if self.result_input is None else inputs[self.result_input]


class LayerCalls:
    """The calls recorded in the current step's layer loop (`scope`), by the caller's key;
    outside a scope, or for another batch or thread, every call runs as it is."""

    def __init__(self) -> None:
        # False: every call runs as it is, in scopes too (a benchmark's ablation of the replay).
        self.replay = True
        self._batch: object = None
        self._calls: dict[Any, Recorded | None] = {}
        self._thread = 0

    @contextmanager
    def scope(self, batch: object) -> Iterator[None]:
        """One step's layer loop over `batch`. What its calls recorded is dropped at the end,
        so that the scratch buffers they hold go back to the allocator. Inert while a CUDA graph
        is captured: a replayed graph launches nothing from the host, so there is nothing to
        save, and the captured graph stays what launching each layer gives."""
        outer = self._batch, self._calls, self._thread
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            batch = None
        self._batch, self._calls, self._thread = batch, {}, threading.get_ident()
        try:
            yield
        finally:
            self._batch, self._calls, self._thread = outer

    def run(
        self, batch: object, key: Any, inputs: Sequence[torch.Tensor], call: Callable[[], R]
    ) -> R:
        """`call()`, or the launches of the scope's first call with `key` replayed with
        `inputs` (the per-layer tensors `call` passes to its kernels) in place of its."""
        if (
            batch is not self._batch
            or batch is None
            or not self.replay
            or self._thread != threading.get_ident()
        ):
            return call()
        recorded = self._calls.get(key)
        if recorded is not None and recorded.fits(inputs):
            return recorded.replay(inputs)
        with recording() as launches:
            result = call()
        self._calls[key] = Recorded.make(launches, inputs, result)
        return result
