"""Tests of `mnemojax.serving` (and `python -m mnemojax.serve`)."""
