"""Where kernel tests run: the GPU when there is one, else the CPU under Triton's interpreter."""

from __future__ import annotations

import torch

from m3serve.backends.reference import ReferenceBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

# The exact torch backend on the CPU: what model tests load checkpoints onto.
CPU_REFERENCE = ReferenceBackend(torch.device("cpu"))
