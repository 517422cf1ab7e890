"""Ops, one file per family: exact torch references (CPU and GPU) and, later, Triton kernels.

The torch functions here define the semantics; every faster kernel is tested against them.
"""
