"""Native CPU kernels (C, compiled on first use) for weights that stay in their quantized GGUF blocks."""
