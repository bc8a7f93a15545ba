"""Test set-up: 8 fake CPU devices, float32 matmuls at full precision.

XLA_FLAGS must be set before jax is imported anywhere, so this runs first.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines built by tests compile each step shape when first needed instead of all at start-up (each test
# would otherwise compile every bucket); tests/engine/test_compiles.py turns precompiling on and checks it.
os.environ.setdefault("MNEMOJAX_PRECOMPILE", "0")
# XLA's CPU client runs computations on as many threads as the machine has cores, or NPROC (read when jax starts,
# so here): the Mosaic GPU interpreter's three-consumer programs, 4 warpgroup threads blocked at barriers at once,
# hung on 2 cores and ran with NPROC=8 (`mosaic_attention.check_interpreter_threads`). It sizes the pool for every
# test; the default suite's time with it is in docs/benchmarks.md (seventeenth session)
os.environ.setdefault("NPROC", "8")
# On the CPU, XLA's compiles are most of a cold run's time (an empty compilation cache: CI's fresh clone). So the
# tests compile without LLVM's optimisations (`--xla_backend_optimization_level=0`), and JAX's persistent cache keeps
# every executable, not only those that took over a second to compile (the same small programs compile in many test
# files and in the servers the tests start, which inherit both settings), in the engine's cache directory. With an
# empty cache the default suite on the 2-core VM took 794 s without these and 574 s with them, the same day and the
# same tests (docs/benchmarks.md, forty-second session). The flag changes how fast the compiled code is made and runs,
# not what it computes: no fast-math either way, and the tests that ask two programs for the same bits pass under it.
# (XLA's older elemental emitters as well, `--xla_cpu_use_fusion_emitters=false`, were faster still, but with both
# flags a kernel's lse differed by an ulp between launches that do the same arithmetic.) The flag only on the CPU: a
# GPU run (JAX_PLATFORMS=cuda,cpu) compiles as a user's would. What the environment already sets wins.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/mnemojax/jax"))
_FLAGS = ["--xla_force_host_platform_device_count=8"]
if os.environ["JAX_PLATFORMS"] == "cpu":
    _FLAGS.append("--xla_backend_optimization_level=0")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# ---------------------------------------------------------------------------------------------------------------
# Memory mappings. Every XLA CPU executable maps its own code pages, and jax keeps every compiled executable
# while its jit cache holds it, so one pytest process running the whole suite accumulates mappings: measured,
# ~43,000 a third of the way through the default suite. Linux refuses a process more than vm.max_map_count of
# them (65,530 by default); past it LLVM's next code mapping fails inside an XLA compile and the process dies
# (a segfault or an abort in whatever test compiles then: what a reordered suite hit in CI). So after a test
# module that leaves more than MAX_MAPPINGS, the jit caches are cleared and the executables they held collected.
# Per module, not per test: a module's engines (module-scoped fixtures) keep their compiled steps for all its
# tests (tests/engine/test_compiles.py counts compiles on one), and one module adds at most ~12,000 mappings.
MAX_MAPPINGS = 30_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to guard
        return 0


@pytest.fixture(scope="module", autouse=True)
def _bounded_memory_mappings():
    yield
    if _mappings() > MAX_MAPPINGS:
        import gc

        jax.clear_caches()
        gc.collect()
