"""The rank pools the tests run their bodies on: :mod:`safe_zero.ranks`, shared with ``benchmarks/run.py``."""

from safe_zero.ranks import DistPool, Pools, RankError, RankFailure

__all__ = ["DistPool", "Pools", "RankError", "RankFailure"]
