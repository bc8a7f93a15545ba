"""Profile N engine steps: device time per kernel, launches per step, device busy against wall time.

A thin shell over `mnemojax.bench.profile_step` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.profile_step import main  # noqa: E402

if __name__ == "__main__":
    main()
