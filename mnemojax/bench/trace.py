"""A `jax.profiler` trace of N calls, read with jax's `ProfileData` (no TensorBoard): the device's kernels (name,
calls, time), launches per call, device busy time against wall time. Used by `profile_step` (engine steps) and
`attention` (`--profile`: one layer's attention).

On a GPU the kernels are the events of the device's streams (`/device:GPU:0`); on a CPU, XLA's thunks on its
client threads.
"""
from __future__ import annotations

import glob
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Kernel:
    name: str
    calls: int
    total_ns: float


@dataclass
class StepProfile:
    steps: int
    wall_ms: float  # per step
    kernels: list[Kernel]  # by total time, largest first
    busy_ms: float  # per step: the union of the kernels' intervals
    device: str

    @property
    def launches(self) -> float:
        return sum(k.calls for k in self.kernels) / self.steps

    def table(self, top: int = 25) -> str:
        total = sum(k.total_ns for k in self.kernels) or 1.0
        lines = [f"{'kernel':<60} {'calls/step':>10} {'ms/step':>9} {'share':>6}"]
        for k in self.kernels[:top]:
            name = k.name if len(k.name) <= 60 else k.name[:57] + "..."
            lines.append(f"{name:<60} {k.calls / self.steps:>10.1f} {k.total_ns / self.steps / 1e6:>9.3f} "
                         f"{k.total_ns / total:>6.1%}")
        if len(self.kernels) > top:
            rest = self.kernels[top:]
            lines.append(f"{f'({len(rest)} more kernels)':<60} {sum(k.calls for k in rest) / self.steps:>10.1f} "
                         f"{sum(k.total_ns for k in rest) / self.steps / 1e6:>9.3f} "
                         f"{sum(k.total_ns for k in rest) / total:>6.1%}")
        lines.append(f"per step ({self.device}): {self.launches:.0f} kernel launches, device busy {self.busy_ms:.3f} ms, "
                     f"wall {self.wall_ms:.3f} ms, busy / wall {self.busy_ms / self.wall_ms:.1%}")
        return "\n".join(lines)


def _leaves(events):
    """The events of one timeline that contain no other (a CPU trace nests an XLA while loop's body, and the thunk
    executor's own spans, inside their parents); GPU kernels do not nest, so all of them."""
    events = sorted(events, key=lambda e: (e[1], -e[2]))
    parents, stack = set(), []
    for i, (_, start, dur) in enumerate(events):
        while stack and events[stack[-1]][1] + events[stack[-1]][2] <= start:
            stack.pop()
        if stack:
            parents.add(stack[-1])
        stack.append(i)
    return [e for i, e in enumerate(events) if i not in parents]


def _device_events(path: str):
    """(device name, [(name, start_ns, duration_ns)]) of the trace: the GPU streams' kernels when there is a
    GPU plane, else the XLA CPU client's thunks."""
    from jax._src.lib import _profile_data

    data = _profile_data.ProfileData.from_file(path)
    planes = list(data.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    events = []
    if gpu:
        for plane in gpu[:1]:
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue
                events += _leaves([(e.name, e.start_ns, e.duration_ns) for e in line.events if e.duration_ns > 0])
        return gpu[0].name, events
    for plane in planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            events += _leaves([(e.name, e.start_ns, e.duration_ns) for e in line.events
                               if e.duration_ns > 0 and not e.name.startswith(("ThreadpoolListener", "end: ", "ThunkExecutor"))])
    return "/host:CPU (XLA thunks)", events


def _busy_ns(events) -> float:
    """The length of the union of the events' intervals."""
    total, end = 0.0, float("-inf")
    for _, start, dur in sorted(events, key=lambda e: e[1]):
        if start > end:
            total, end = total + dur, start + dur
        elif start + dur > end:
            total, end = total + start + dur - end, start + dur
    return total


def profile_calls(step, steps: int, idle, trace_dir: str | None = None) -> StepProfile:
    """Records `steps` calls of `step()` (`idle()` waits until the device has done all of them) and summarises
    the trace per call."""
    import jax

    trace_dir = trace_dir or tempfile.mkdtemp(prefix="mnemojax-profile-")
    idle()
    jax.profiler.start_trace(trace_dir)
    t = time.perf_counter()
    try:
        for _ in range(steps):
            step()
        idle()
    finally:
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
    device, events = _device_events(paths[-1])
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, _, dur in events:
        by_name[name].append(dur)
    kernels = sorted((Kernel(n, len(d), float(sum(d))) for n, d in by_name.items()), key=lambda k: -k.total_ns)
    return StepProfile(steps, wall / steps * 1e3, kernels, _busy_ns(events) / steps / 1e6, device)
