"""Small reference models in Flax nnx (used by the interop tests, the demo and benchmarks)."""
