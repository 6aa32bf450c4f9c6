"""Routing, recorded and replayed: the per-step routing trace (routing_trace.py, JSON lines; read
back by trace_file.py; one file per EP layout across resumes: segments.py), its rebalance
records (rebalance_records.py), record / replay of the top-k choice (replay.py) with its
safetensors routes file (routes_file.py), and the trace's plot (plot.py,
`python -m moe.trace.plot TRACE.jsonl OUT.png`; needs matplotlib)."""
