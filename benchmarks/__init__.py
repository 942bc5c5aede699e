"""Benchmarks of microplan against faithful re-implementations of the peers' planners.

Run from the repository root: ``python -m benchmarks.bench_planners --quick`` and
``python -m benchmarks.bench_speed``. See benchmarks/README.md.
"""
