"""What a decoded request body may hold: the values the engine's wire can carry.

msgspec decodes a JSON integer of any size and objects nested as deep as Python's recursion
allows; msgpack (the actors' wire) and the engine take 64-bit integers only, and deep nesting
breaks whatever recurses over it later (the chat template, the codec). `problem` finds the first
such value, walking the body without recursion.
"""

from __future__ import annotations

from typing import Any

import msgspec

INT64 = range(-(2**63), 2**63)  # `in range` is a constant-time bounds check
MAX_DEPTH = 64  # objects and arrays inside each other; JSON schemas of real tools stay far below


def problem(value: Any) -> tuple[str, str | None] | None:
    """(message, param) for the first integer beyond 64 bits or nesting beyond `MAX_DEPTH`
    levels in a decoded body; None when the body is fine."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if item not in INT64:
                return f"the integer {item} at {path or 'the body'} does not fit in 64 bits", path
            continue
        children = _children(item)
        if children is None:
            continue
        if depth == MAX_DEPTH:
            return f"the body is nested deeper than {MAX_DEPTH} levels (at {path})", path
        for key, child in children:
            if isinstance(child, (int, list, dict, msgspec.Struct)):
                stack.append((child, depth + 1, _join(path, key)))
    return None


def _children(item: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(item, msgspec.Struct):
        return [(name, getattr(item, name)) for name in item.__struct_fields__]
    if isinstance(item, dict):
        return list(item.items())
    if isinstance(item, list):
        return None if _small_ints(item) else list(enumerate(item))
    return None


def _small_ints(items: list[Any]) -> bool:
    """True for a list of numbers whose smallest and largest are 64-bit integers, so every
    integer in it is one too; checked at C speed, as token-id lists run to millions. Lists of
    anything else (a TypeError, or a non-int extreme) are walked item by item."""
    try:
        low, high = min(items), max(items)
    except (TypeError, ValueError):
        return False
    return type(low) is int and type(high) is int and low in INT64 and high in INT64


def _join(path: str, key: Any) -> str:
    # msgspec's own error paths: `messages[0].content`.
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)
