"""The MiniMax-M3.1 network: config parsing, layers, paged forward, weight loading, quant formats,
chat template, special tokens, thinking controls.

The layers call every op through the backend they were built with; `backend.py` is that
contract, and nothing here imports a backend.
"""
