"""Triton kernels for vertical-slash sparse attention (installed as ``mtraining_kernels``)."""
