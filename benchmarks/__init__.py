"""Benchmark programs, each run as a script (see its docstring); they and the tests import each
other as `benchmarks.*` from the repository root."""
