"""The model's building blocks on each backend: attention (SDPA on CPU, Triton on CUDA) and fused kernels."""
