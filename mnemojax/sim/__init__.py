"""Simulation and planning: the real scheduler loop with the predictor as the clock (`simulator`: traces,
metrics, reports) and the deployment planner built on it (`planner`). Plain Python, no jax.
`python -m mnemojax.sim` simulates one deployment; `python -m mnemojax.plan` plans one.
"""
