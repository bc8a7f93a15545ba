"""Mesh construction, axis names, the partition-spec table and the collective primitives.

Imports nothing from `models` or `mnemojax`.
"""
from shardings.mesh import AXES, KVP, SPP, TP, make_mesh
from shardings.specs import ShardingTable

__all__ = ["AXES", "KVP", "SPP", "TP", "make_mesh", "ShardingTable"]
