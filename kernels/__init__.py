"""Fused kernels (Triton on GPU, PyTorch fallback elsewhere)."""
