"""The deployment planner at paper scale (SPP prefill scaling, when KVP pays off), beside Medha's numbers.

A thin shell over `mnemojax.bench.plan_medha` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.plan_medha import main  # noqa: E402

if __name__ == "__main__":
    main()
