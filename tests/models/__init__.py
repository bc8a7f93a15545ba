"""Tests of `models`."""
