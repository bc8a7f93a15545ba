"""The deployment planner's prediction against the real engine on fake CPU devices.

A thin shell over `mnemojax.bench.plan_validation` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.plan_validation import main  # noqa: E402

if __name__ == "__main__":
    main()
