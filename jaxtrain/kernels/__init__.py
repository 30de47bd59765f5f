"""Attention kernels (Pallas flash attention for GPU and TPU, ring attention) and their jnp reference."""
