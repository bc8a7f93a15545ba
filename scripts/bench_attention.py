"""Attention kernel time vs chunk size at long context (Mnemosyne Figure 7 / Medha Figure 5b), and decode.

A thin shell over `mnemojax.bench.attention` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.attention import main  # noqa: E402

if __name__ == "__main__":
    main()
