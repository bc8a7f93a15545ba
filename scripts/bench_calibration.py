"""Online calibration timed on this machine's wall clock: P99 of steps with decodes, TTFT ILRS vs FCFS.

A thin shell over `mnemojax.bench.calibration` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.calibration import main  # noqa: E402

if __name__ == "__main__":
    main()
