"""Host time per engine step, split by part, against the device's.

A thin shell over `mnemojax.bench.host` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.host import main  # noqa: E402

if __name__ == "__main__":
    main()
