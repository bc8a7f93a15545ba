"""The micro-batches in flight in a pipeline of `spp` stages: plain Python, no jax.

One clocked step moves every micro-batch one stage on: a new one enters stage 0, and the one that entered
`num_stages - 1` steps earlier is in the last stage and leaves at the end of the step. While the pipeline fills,
empty micro-batches (padding) stand in the stages nothing has reached yet, so a micro-batch always leaves
`num_stages` steps after it entered (counting its own step), and with one stage in the step it entered.

The executor holds its device micro-batches in one, the simulator its predicted ones, the scheduler's tests
their plans: the same queue, so the three cannot disagree on when a micro-batch comes back.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Pipeline(Generic[T]):
    """`num_stages` micro-batches in flight once full; stage s holds the one that entered s steps ago."""

    def __init__(self, num_stages: int):
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
        self.num_stages = num_stages
        self._stages: deque[T] = deque()  # newest first

    def push(self, item: T, padding: Callable[[], T]) -> T:
        """`item` enters stage 0; stages nothing has reached yet get `padding()`. Returns the micro-batch in the
        last stage: it leaves when the step is done (`pop`)."""
        if len(self._stages) >= self.num_stages:
            raise RuntimeError("push before the micro-batch in the last stage was popped")
        self._stages.appendleft(item)
        while len(self._stages) < self.num_stages:
            self._stages.append(padding())
        return self._stages[-1]

    def pop(self) -> T:
        """Removes and returns the micro-batch in the last stage (its step is done)."""
        if len(self._stages) < self.num_stages:
            raise RuntimeError("pop of a pipeline that is not full: push first")
        return self._stages.pop()

    def __iter__(self) -> Iterator[T]:
        """The micro-batches in stage order (newest first)."""
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    def copy(self) -> Pipeline[T]:
        """A pipeline holding the same micro-batches (the items themselves are shared)."""
        other = Pipeline(self.num_stages)
        other._stages = deque(self._stages)
        return other
