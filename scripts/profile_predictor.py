"""Fits the runtime predictor's efficiency factors to timed steps of the real executor; saves a profile.

A thin shell over `mnemojax.bench.profile_predictor` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.profile_predictor import main  # noqa: E402

if __name__ == "__main__":
    main()
