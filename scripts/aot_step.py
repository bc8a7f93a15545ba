"""Compile the engine's step for a GPU this machine may lack (XLA's deviceless compilation) and count what it
launches per step and per layer.

A thin shell over `mnemojax.bench.aot_step` (its docstring has the details); needs jax's CUDA plugin, not a GPU.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.aot_step import main  # noqa: E402

if __name__ == "__main__":
    main()
