"""Scheduler time per step, and simulator speed.

A thin shell over `mnemojax.bench.scheduler` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.scheduler import main  # noqa: E402

if __name__ == "__main__":
    main()
