"""The sampler's top-k / top-p filter: bisection thresholds against a full-vocabulary sort.

A thin shell over `mnemojax.bench.sampler` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.sampler import main  # noqa: E402

if __name__ == "__main__":
    main()
