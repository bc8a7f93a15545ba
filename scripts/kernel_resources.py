"""What ptxas makes of the Mosaic GPU attention kernels (registers, spills, SMEM per kernel option), compiled for
an H100 / H200 on any machine.

A thin shell over `mnemojax.bench.kernel_resources` (its docstring has the details); needs jax >= 0.11 with its CUDA
plugin, not a GPU.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.kernel_resources import main  # noqa: E402

if __name__ == "__main__":
    main()
