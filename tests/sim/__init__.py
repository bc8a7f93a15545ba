"""Tests of `mnemojax.sim`."""
