"""Tests of dora_jax. JAX must not grab 75% of the GPU up front: torch tests share the process."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
