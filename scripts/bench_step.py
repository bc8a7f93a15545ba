"""Whole-model step efficiency on one GPU: prefill MFU and decode MBU against measured ceilings, and an exact
1M-token prefill + decode (TTFT, TBT).

A thin shell over `mnemojax.bench.step` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.step import main  # noqa: E402

if __name__ == "__main__":
    main()
