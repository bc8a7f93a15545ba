"""Tests of `mnemojax.bench` (the benchmark modules behind `scripts/`)."""
