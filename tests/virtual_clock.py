"""A virtual clock and device for the engine: its steps take the time a predictor (the *machine*) gives them, so
timing-dependent behaviour (adaptive chunking, calibration, TTFT, ILRS deadlines) is deterministic in tests."""
from __future__ import annotations

import math
import random
from collections.abc import Callable

from mnemojax.scheduling.predictor import Predictor


class VirtualMachine:
    """The engine's clock and device, virtual. Build the engine with `clock=vm.clock`, then `vm.attach(engine)`.

    A step launched at `now` first spends `host_s` of host time, then starts when the device is free and runs for
    `machine.step_time` of its busiest KVP rank's shapes, times `noise(step index)`; its collect (or, when it
    fetches results synchronously, the launch itself) moves `now` to its end. Records every step's (device seconds,
    decodes, prefill tokens) in `steps`.
    """

    def __init__(self, machine: Predictor | None = None, *, host_s: float = 0.0,
                 noise: Callable[[int], float] | None = None):
        self.machine, self.host_s, self.noise = machine, host_s, noise
        self.now = self.free_at = 0.0
        self.steps: list[tuple[float, int, int]] = []
        self._ends: dict[int, float] = {}

    def clock(self) -> float:
        return self.now

    def attach(self, engine) -> None:
        executor = engine.executor
        launch, collect = executor.launch, executor.collect

        def timed_launch(plan, fetch=False):
            per_rank = engine.scheduler.plan_shapes(plan)  # before the plan's requests move on
            seconds = max((self.machine.step_time(shapes) for shapes in per_rank), default=0.0)
            if self.noise is not None:
                seconds *= self.noise(len(self.steps))
            self.steps.append((seconds, sum(ch.num_tokens == 1 for ch in plan.chunks),
                               sum(ch.num_tokens for ch in plan.chunks if ch.num_tokens > 1)))
            self.now += self.host_s
            launched = launch(plan, fetch)
            self.free_at = max(self.now, self.free_at) + seconds
            self._ends[id(launched)] = self.free_at
            if fetch and launched.out is not None:  # synchronous: the launch waited for the results
                self.now = self.free_at
            return launched

        def timed_collect(launched):  # it waits for the step to end
            self.now = max(self.now, self._ends.pop(id(launched), self.now))
            return collect(launched)

        executor.launch, executor.collect = timed_launch, timed_collect


def lognormal_noise(sigma: float, seed: int, hiccups: dict[int, float] | None = None) -> Callable[[int], float]:
    """Step i's time factor: exp(N(0, sigma)) from a seeded generator, times `hiccups.get(i, 1)`."""
    rng = random.Random(seed)
    return lambda i: math.exp(rng.gauss(0.0, sigma)) * (hiccups or {}).get(i, 1.0)
