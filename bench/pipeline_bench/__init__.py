"""Modules of bench.pipeline: the rank worker, launchers, theoretical bubbles, report."""
