"""docs/notebooks/quickstart.ipynb runs top to bottom without an error.

The notebook asserts itself that the 2x2x2 mesh gives one device's tokens and prompt log-probs, so this test
also fails if they differ. It runs in a fresh IPython kernel under this interpreter (`sys.executable`,
whatever kernelspecs are installed), from the repository root, so `import mnemojax` works as it does here.
The fake-device flag that tests/conftest.py put in XLA_FLAGS is removed from the kernel's environment: the
notebook's own setup cell must set it.
"""
import os


import ipykernel.kernelspec as ipykernel_kernelspec  # the test extra installs these
import nbclient
import nbformat
import pytest
from jupyter_client import AsyncKernelManager  # a dependency of nbclient
from jupyter_client.kernelspec import KernelSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "docs", "notebooks", "quickstart.ipynb")
FAKE_DEVICES = "--xla_force_host_platform_device_count=8"


class ThisPythonKernelManager(AsyncKernelManager):
    """Starts ipykernel under `sys.executable` instead of looking up an installed kernelspec (which may name
    another Python, one without jax or mnemojax)."""

    @property
    def kernel_spec(self):
        return KernelSpec(resource_dir="", **ipykernel_kernelspec.get_kernel_dict())


@pytest.mark.slow  # ~17 s on 2 cores: a Jupyter kernel runs the whole notebook
def test_quickstart_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code"), "save the notebook with its outputs cleared"
    env = dict(os.environ)
    flags = env.pop("XLA_FLAGS", "").replace(FAKE_DEVICES, "").strip()
    if flags:
        env["XLA_FLAGS"] = flags
    client = nbclient.NotebookClient(nb, kernel_name="python3", kernel_manager_class=ThisPythonKernelManager,
                                     timeout=300, startup_timeout=120, resources={"metadata": {"path": ROOT}})
    client.execute(env=env)  # raises CellExecutionError naming the cell and its traceback
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "same tokens" in outputs and "ilrs" in outputs
    assert sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs) == 2
