"""Numba kernels over numpy arrays: quantized matmul per GGUF format, attention over the KV
cache, row operations, and the SIMD building blocks they share.

Importing them changes nothing in the process: where they are cached and what they are
compiled for is set by ``configure_process`` (jit.py holds the settings it makes).
"""
