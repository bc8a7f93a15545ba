"""Load generator: replays a trace against an OpenAI-compatible `/v1/completions` endpoint, streaming, and
reports TTFT, TBT and end-to-end latency.

A thin shell over `mnemojax.bench.serving` (its docstring has the details).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from mnemojax.bench.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as they are printed, even when piped
    main()
