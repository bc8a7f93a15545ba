"""TTFT of a follow-up question over a shared context, with and without the prefix cache.

A thin shell over `mnemojax.bench.prefix` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.prefix import main  # noqa: E402

if __name__ == "__main__":
    main()
