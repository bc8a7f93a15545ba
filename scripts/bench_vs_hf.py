"""Greedy decode throughput of mnemojax against Hugging Face `transformers` `generate`, same weights, CPU.

A thin shell over `mnemojax.bench.vs_hf` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.vs_hf import main  # noqa: E402

if __name__ == "__main__":
    main()
