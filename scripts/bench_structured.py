"""Host cost of structured outputs' regex masks on a vocabulary of Llama-3's size.

A thin shell over `mnemojax.bench.structured` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.structured import main  # noqa: E402

if __name__ == "__main__":
    main()
