"""Test set-up: 8 fake CPU devices, float32 matmuls at full precision.

XLA_FLAGS must be set before jax is imported anywhere, so this runs first.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines built by tests compile each step shape when first needed instead of all at start-up (each test
# would otherwise compile every bucket); tests/engine/test_compiles.py turns precompiling on and checks it.
os.environ.setdefault("MNEMOJAX_PRECOMPILE", "0")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
