"""Where a checkpoint tensor lands in M3ForCausalLM, by rules written independently of the
product's inventory (so a naming bug there cannot hide behind the same bug here)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

PREFIX = "language_model."


# Attention projections stacked row-wise into `self_attn.qkv_proj`, in this order.
QKV = ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")
Part = str | slice | None


def destination(
    name: str, rows: Mapping[str, int] | None = None
) -> tuple[str, int | None, Part] | None:
    """Where a logical checkpoint weight lands in M3ForCausalLM: (parameter, expert, part)
    where part is 'first'/'second' for row halves of a fused tensor, or the row slice of a
    q/k/v/indexer projection in the fused qkv (from `rows`: each logical weight's row count).
    None: not a text weight."""
    if not name.startswith(PREFIX):
        return None
    full, name = name, name.removeprefix(PREFIX)
    attention = re.fullmatch(r"(.+\.self_attn)\.(\w+_proj)\.weight", name)
    if attention and attention.group(2) in QKV:
        assert rows is not None, "qkv members need the row counts of their layer"
        base, which = attention.groups()
        before = QKV[: QKV.index(which)]
        start = sum(rows.get(full.replace(which, other), 0) for other in before)
        return f"{base}.qkv_proj.weight", None, slice(start, start + rows[full])
    expert = re.fullmatch(r"(.+\.experts)\.(\d+)\.(w1|w2|w3)\.weight", name)
    if expert:
        base, index, which = expert.groups()
        if which == "w2":
            return f"{base}.w2", int(index), None
        return f"{base}.w13", int(index), "first" if which == "w1" else "second"
    gated = re.fullmatch(r"(.+)\.(gate|up)_proj\.weight", name)
    if gated:
        base, which = gated.groups()
        return f"{base}.gate_up_proj.weight", None, "first" if which == "gate" else "second"
    return name, None, None


def param_block(param: torch.Tensor, expert: int | None, part: Part) -> torch.Tensor:
    block = param if expert is None else param[expert]
    if part is None:
        return block
    if isinstance(part, slice):
        return block[part]
    rows = block.shape[0] // 2
    return block[:rows] if part == "first" else block[rows:]


# ------------------------------------------------------------------------------- fixtures
