"""The MiniMax-M3.1 network: config parsing, layers, paged forward, weight loading, quant formats.

Model code never calls a kernel directly; every op goes through the backend it was built with.
"""
