"""Where kernel tests run: the GPU when there is one, else the CPU under Triton's interpreter."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
