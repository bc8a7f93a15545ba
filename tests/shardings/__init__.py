"""Tests of `shardings`."""
