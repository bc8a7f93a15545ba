"""The multi-prefill step against a single-sequence step with the same number of tokens (issue 12, item 6).

A thin shell over `mnemojax.bench.multi_prefill` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.multi_prefill import main  # noqa: E402

if __name__ == "__main__":
    main()
