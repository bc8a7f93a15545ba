"""The test suite as a package, so helpers import as `from tests.hf_utils import ...` under both `pytest`
and `python -m pytest` (pytest puts the repository root on `sys.path` for a package of tests).

`hf_utils` is also registered under its bare name, so `import hf_utils` finds the same module object.
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root."""

from tests import hf_utils  # noqa: E402

sys.modules.setdefault("hf_utils", hf_utils)
