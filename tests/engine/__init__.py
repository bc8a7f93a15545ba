"""Tests of `mnemojax.engine`."""
