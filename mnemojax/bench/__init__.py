"""Benchmarks and profiling tools (the logic behind `scripts/`): they measure the engine, the server and
the kernels; nothing in the engine imports them."""
