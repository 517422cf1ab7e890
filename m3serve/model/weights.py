"""How the model holds its projection and expert weights: dense in the compute dtype, or in the
checkpoint's quantized format when the backend reads that format itself (MXFP8 projections,
NVFP4 experts; `Backend.weight_formats`). Quantized weights are never dequantized in memory.

A fused weight (q/k/v + indexer projections, gate/up, an expert layer's w1/w3/w2) keeps its
checkpoint format only if every module fused into it has that format; otherwise it is dense.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from m3serve.model.config import QuantConfig

WeightFormat = Literal["dense", "MXFP8", "NVFP4"]

# The real (VL) checkpoint's prefix of every text-backbone tensor and module name.
CHECKPOINT_PREFIX = "language_model."


@dataclass(frozen=True)
class Mxfp8Weight:
    """A projection W [N, K] as MXFP8: W[n, k] = codes[n, k] * 2**(scales[n, k // 32] - 127)."""

    codes: Tensor  # [N, K] float8_e4m3fn
    scales: Tensor  # [N, K // 32] uint8, E8M0 exponents
    # W in bf16 as well (`--mxfp8-bf16-copy`), for the rows that would dequantize it per call.
    bf16: Tensor | None = None


@dataclass(frozen=True)
class Nvfp4Experts:
    """A layer's routed experts as NVFP4 (E2M1 codes two per byte, element 2i in the low nibble;
    an e4m3 scale per 16 along K; a float32 global scale). w13's rows are w1 (gate) then w3 (up),
    each half with its own global scale.

    `tiled`: the codes and scales are held with their rows tiled for the MoE kernels
    (`m3serve.kernels.nvfp4_tiles`), as 5-d views [E, R/32, K/TK, 32, TK/2 or TK/16]."""

    w13: Tensor  # [E, 2I, H/2] uint8
    w13_scale: Tensor  # [E, 2I, H/16] float8_e4m3fn
    w13_global: Tensor  # [E, 2] float32: the w1 half's, the w3 half's
    w2: Tensor  # [E, H, I/2] uint8
    w2_scale: Tensor  # [E, H, I/16] float8_e4m3fn
    w2_global: Tensor  # [E] float32
    tiled: bool = False


@dataclass(frozen=True)
class DenseExperts:
    w13: Tensor  # [E, 2I, H], gate rows first
    w2: Tensor  # [E, H, I]


LinearWeight = Tensor | Mxfp8Weight
ExpertWeights = DenseExperts | Nvfp4Experts


@dataclass(frozen=True)
class WeightFormats:
    """Which format each weight is held in: the checkpoint's, where `readable` (the backend's
    `weight_formats`) includes it, else dense."""

    quant: QuantConfig | None = None
    readable: frozenset[str] = frozenset()

    def of(self, modules: Iterable[str]) -> WeightFormat:
        """The format of a weight fused from `modules` (checkpoint module names without the
        `language_model.` prefix)."""
        if self.quant is None:
            return "dense"
        algos = {self._algo(module) for module in modules}
        if len(algos) != 1:
            return "dense"
        (algo,) = algos
        return algo if algo in self.readable else "dense"  # type: ignore[return-value]

    def _algo(self, module: str) -> str | None:
        assert self.quant is not None
        return self.quant.algo_for(CHECKPOINT_PREFIX + module) or self.quant.algo_for(module)
