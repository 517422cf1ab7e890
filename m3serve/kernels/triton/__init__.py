"""Triton kernels for the Hopper backend, one module per op family. Each is tested against the
torch reference in `m3serve.kernels` (on the CPU under TRITON_INTERPRET=1, on real shapes on
the GPU). Importing this package needs `triton`; the reference backend never does."""
