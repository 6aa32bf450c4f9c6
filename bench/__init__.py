"""Benchmarks: scripts, not tests. Each runs from the repository root as a module,
`python -m bench.NAME` (multi-rank ones under `torchrun ... -m bench.NAME`), and imports only
moe, examples and bench itself; dated reports go to bench/results/."""
