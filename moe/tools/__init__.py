"""Command-line tools (python -m moe.tools.<name>)."""
