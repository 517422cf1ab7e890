"""The Triton SwiGLU-OAI at the model's widths (H200): shared expert 3072, dense MLP 12288.

Each result is the fp32 reference rounded once to bf16, up to fp32 noise (Triton's exp is the
ex2-based approximation): within one bf16 ulp per element, and the whole tensor within 1e-2
relative error. A CUDA-graph replay checks the kernel needs no host sync.
"""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.activation import swiglu_oai as reference
from m3serve.kernels.triton.swiglu import swiglu_oai

DEV = torch.device("cuda")
ALPHA, LIMIT = 1.702, 7.0


def gate_up(rows: int, width: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(rows + width)
    return (torch.randn(rows, 2 * width, generator=g, device=DEV) * 6.0).to(torch.bfloat16)


@pytest.mark.parametrize("width", [3072, 12288])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 257, 2048])
def test_swiglu_is_the_fp32_result_rounded_once(rows: int, width: int) -> None:
    x = gate_up(rows, width)
    got = swiglu_oai(x, ALPHA, LIMIT).float()
    exact = reference(x.float(), ALPHA, LIMIT)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-30)
    assert ((got - exact).abs() <= ulp).all()
    assert float((got - exact).norm() / exact.norm()) < 1e-2


def test_swiglu_replays_from_a_cuda_graph() -> None:
    x = gate_up(8, 3072)
    swiglu_oai(x, ALPHA, LIMIT)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = swiglu_oai(x, ALPHA, LIMIT)
    x.copy_(gate_up(8, 3072) * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, swiglu_oai(x, ALPHA, LIMIT))
