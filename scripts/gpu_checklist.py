"""The open GPU measurements in one command, stage by stage within a time budget (a device session's calls).

A thin shell over `mnemojax.bench.gpu_checklist` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.gpu_checklist import main  # noqa: E402

if __name__ == "__main__":
    main()
