"""Examples of the moe library (importable so the test suite can drive them)."""
