"""Fused kernels for the GPU path (Triton); each module carries a torch reference it is tested against.

Importing this package never imports Triton's compiler work: kernels compile on first call, and
a host without Triton can still import the references.
"""
