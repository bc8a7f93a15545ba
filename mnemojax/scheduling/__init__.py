"""Scheduling: what to run in each step, in plain Python (no jax, no numpy).

The configs (`config`), requests and their sampling parameters and outputs, the paged KV manager, the
scheduler with its update half (`Scheduler.update_from_output`), the spp in-flight `pipeline`, shape
`buckets`, and the runtime `predictor` with its shipped `profiles/`. The engine and the simulator both drive
these; a test (`tests/scheduling/test_no_jax.py`) checks that nothing here imports jax.
"""
