"""dora_jax — DoRA for JAX/Flax with a factored norm and Pallas kernels."""
