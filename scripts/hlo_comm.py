"""Bytes moved by the collectives of one compiled engine step, per mesh axis, against the Medha formulas.

A thin shell over `mnemojax.bench.hlo_comm` (its docstring has the details).
"""
import os
import sys

# before jax is imported: 8 fake CPU devices
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.hlo_comm import main  # noqa: E402

if __name__ == "__main__":
    main()
