"""Pieces of bench/alltoall.py: runner, network emulation, cost-model fit, report, plots."""
