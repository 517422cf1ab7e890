"""Ops on tensors, one file per family: the exact torch references (CPU and GPU) here, the
Triton kernels of the Hopper backend in `kernels/triton/`.

The torch functions define the semantics; every faster kernel is tested against them. Nothing
here knows about requests, messages or the model: inputs are tensors and plain numbers.
"""
