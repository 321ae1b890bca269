"""Kernel backends (imported lazily by kernels/dispatch.py): cpu, c10d, fa4, triton, flashinfer."""
