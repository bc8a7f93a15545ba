"""Tests of `mnemojax.scheduling`."""
