"""The wake factor of `mnemojax.bench.profile_predictor`: measured with a fake clock and executor whose step is
slower right after a sleep, and written into a profile file without touching the other factors."""
import json

import pytest

from mnemojax.bench import profile_predictor as pp
from mnemojax.scheduling.predictor import Predictor, Profile
from models.config import preset


class FakeMachine:
    """A step takes `cost[plan]` seconds, times `cold` when it follows a sleep; the clock moves only by them."""

    def __init__(self, cost, cold):
        self.cost, self.cold, self.t, self.slept, self.sleeps = cost, cold, 0.0, False, []

    def sleep(self, s):
        self.sleeps.append(s)
        self.t += s
        self.slept = True

    def execute(self, plan):
        self.t += self.cost[plan] * (self.cold if self.slept else 1.0)
        self.slept = False

    def clock(self):
        return self.t


def test_measure_wake_times_each_plan_after_a_sleep_and_at_once():
    m = FakeMachine({"a": 0.01, "b": 0.04}, cold=1.5)
    pairs = pp.measure_wake(m.execute, ["a", "b"], reps=3, idle_s=0.7, sleep=m.sleep, clock=m.clock)
    assert pairs == [(pytest.approx(0.015), pytest.approx(0.01)), (pytest.approx(0.06), pytest.approx(0.04))]
    assert m.sleeps == [0.7] * 6
    assert pp.wake_factor(pairs) == pytest.approx(1.5)
    assert pp.wake_factor([(0.9, 1.0), (0.95, 1.0), (1.2, 1.0)]) == 1.0  # faster when cold is noise: at least 1
    assert pp.wake_factor([(3.0, 1.0), (1.2, 1.0), (1.4, 1.0)]) == pytest.approx(1.4)  # the median ratio


def test_wake_factor_goes_into_the_profile_file_and_nothing_else_changes(tmp_path):
    path = tmp_path / "p.json"
    Predictor(preset("tiny"), "cpu", profile=Profile(step_overhead_s=3e-3)).save_profile(str(path), model="tiny",
                                                                                        note="kept")
    before = json.loads(path.read_text())
    pairs = [(0.02, 0.01), (0.03, 0.02), (0.05, 0.04), (0.3, 0.2), (0.6, 0.5)]
    after = pp.set_wake(before, pp.wake_record(pairs, 1.0, 5))
    assert after["factors"] == {**before["factors"], "wake_factor": pytest.approx(1.5)}
    assert after["note"] == "kept" and after["wake"]["idle_s"] == 1.0 and len(after["wake"]["plans"]) == 5
    path.write_text(json.dumps(after))
    p = Predictor(preset("tiny"), "cpu", profile=str(path))
    assert p.profile.wake_factor == pytest.approx(1.5) and p.profile.step_overhead_s == 3e-3
    with pytest.raises(ValueError, match="wake_factor must be positive"):
        Profile(wake_factor=0.0)
