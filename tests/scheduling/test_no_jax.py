"""The folder boundary: nothing under `mnemojax/scheduling` imports jax, flax or numpy, and nothing under
`mnemojax/sim` imports jax or flax (the simulator uses numpy for traces and percentiles).

Every module of the two packages is imported in a fresh process (found by walking the folders, so a new module
is covered without editing this test), through the real `mnemojax` package; the modules they import from
`models` (config, kernel names) come along. Scheduling decisions, KV page bookkeeping, the runtime predictor,
the simulator and the planner run on a laptop with none of the accelerator stack installed.
"""
import os
import subprocess
import sys

import pytest

from tests import REPO

ACCELERATOR = ("jax", "jaxlib", "flax")
NOT_IMPORTED = {"mnemojax/scheduling": ACCELERATOR + ("numpy",), "mnemojax/sim": ACCELERATOR}


def _plain_modules(*packages: str) -> list[str]:
    names = []
    for pkg in packages:
        for folder, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in sorted(files):
                if f.endswith(".py") and f != "__main__.py":
                    rel = os.path.relpath(os.path.join(folder, f), REPO)[:-3]
                    names.append(rel.replace(os.sep, ".").removesuffix(".__init__"))
    return sorted(names)


def test_walk_finds_the_modules():
    names = _plain_modules(*NOT_IMPORTED)
    assert {"mnemojax.scheduling.scheduler", "mnemojax.scheduling.kv_manager", "mnemojax.scheduling.predictor",
            "mnemojax.sim.simulator", "mnemojax.sim.planner"} <= set(names)


@pytest.mark.parametrize("package", sorted(NOT_IMPORTED))
def test_plain_packages_import_no_jax(package):
    code = ("import importlib, sys\n"
            f"for name in {_plain_modules(package)!r}:\n"
            "    importlib.import_module(name)\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {NOT_IMPORTED[package]!r})\n"
            "assert not heavy, heavy\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_check_sees_a_heavy_import():
    """The same check fails for a module that imports jax (so a pass above means something)."""
    code = ("import sys, mnemojax.engine.sampler\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {ACCELERATOR!r})\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0 and "jax" in out.stderr
