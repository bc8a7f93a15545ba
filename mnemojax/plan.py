"""`python -m mnemojax.plan --num_gpus 64 ...`: the deployment planner (the command; the planner is
`mnemojax.sim.planner`, the flags are in `mnemojax.sim.plan`)."""
from mnemojax.sim.plan import run

if __name__ == "__main__":
    run()
