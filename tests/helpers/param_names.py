"""Where a checkpoint tensor lands in M3ForCausalLM, by rules written independently of the
product's inventory (so a naming bug there cannot hide behind the same bug here)."""

from __future__ import annotations

import re

import torch

PREFIX = "language_model."


def destination(name: str) -> tuple[str, int | None, str | None] | None:
    """Where a logical checkpoint weight lands in M3ForCausalLM: (parameter, expert, half)
    where half is 'first'/'second' for row halves of a fused tensor. None: not a text weight."""
    if not name.startswith(PREFIX):
        return None
    name = name.removeprefix(PREFIX)
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


def param_block(param: torch.Tensor, expert: int | None, half: str | None) -> torch.Tensor:
    block = param if expert is None else param[expert]
    if half is None:
        return block
    rows = block.shape[0] // 2
    return block[:rows] if half == "first" else block[rows:]


# ------------------------------------------------------------------------------- fixtures
