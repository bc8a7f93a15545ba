"""`mnemojax.bench.profile_predictor`: the wake-up measured with a fake machine whose first token is later right
after a sleep and written into a profile file without touching the other factors; the set-ups per machine; the
fit for a GPU's kernels."""
import json

import pytest

from mnemojax.bench import profile_predictor as pp
from mnemojax.scheduling.predictor import Predictor, Profile
from models.config import preset


class FakeMachine:
    """A new request of n tokens gets its first token `loop` seconds plus its step `cost[n]` after it arrives; right
    after a sleep the step takes `cold` times as long and the host `wake_s` more."""

    def __init__(self, cost, loop, cold, wake_s):
        self.cost, self.loop, self.cold, self.wake_s = cost, loop, cold, wake_s
        self.slept, self.sleeps = False, []

    def sleep(self, s):
        self.sleeps.append(s)
        self.slept = True

    def first_token(self, n):
        t = self.loop + (self.cost[n] * self.cold + self.wake_s if self.slept else self.cost[n])
        self.slept = False
        return t


def test_measure_wake_times_a_first_token_after_a_sleep_and_at_once_and_fits_the_line():
    m = FakeMachine({16: 0.002, 128: 0.01, 256: 0.03}, loop=0.001, cold=1.2, wake_s=0.008)
    points = pp.measure_wake(m.first_token, m.cost.__getitem__, [16, 128, 256], reps=3, idle_s=0.7, sleep=m.sleep)
    assert [p[0] for p in points] == [0.002, 0.01, 0.03]
    assert [p[1] for p in points] == [pytest.approx(0.001 + c * 1.2 + 0.008) for c in (0.002, 0.01, 0.03)]
    assert [p[2] for p in points] == [pytest.approx(0.001 + c) for c in (0.002, 0.01, 0.03)]
    assert m.sleeps == [0.7] * 9
    factor, overhead = pp.wake_fit(points)  # cold = 1.2 x step + 9 ms, exactly
    assert factor == pytest.approx(1.2) and overhead == pytest.approx(0.009)


def test_wake_fit_keeps_its_bounds():
    # a cold first token no slower than the step: factor 1, no overhead
    assert pp.wake_fit([(0.01, 0.009, 0.0), (0.02, 0.019, 0.0)]) == (1.0, 0.0)
    # a line steeper than it is long: overhead 0 and the slope through the origin
    factor, overhead = pp.wake_fit([(0.01, 0.01, 0.0), (0.02, 0.05, 0.0)])
    assert overhead == 0.0 and factor == pytest.approx((0.01 * 0.01 + 0.02 * 0.05) / (0.01 ** 2 + 0.02 ** 2))
    # a flat line (the cold cost all overhead): factor 1, the overhead is the mean excess
    factor, overhead = pp.wake_fit([(0.01, 0.03, 0.0), (0.02, 0.035, 0.0), (0.03, 0.04, 0.0)])
    assert factor == 1.0 and overhead == pytest.approx(0.035 - 0.02)


def test_wake_goes_into_the_profile_file_and_nothing_else_changes(tmp_path):
    path = tmp_path / "p.json"
    Predictor(preset("tiny"), "cpu", profile=Profile(step_overhead_s=3e-3)).save_profile(str(path), model="tiny",
                                                                                        note="kept")
    before = json.loads(path.read_text())
    points = [(0.01, 0.025, 0.011), (0.02, 0.04, 0.021), (0.04, 0.07, 0.042)]  # cold = 1.5 x step + 10 ms
    after = pp.set_wake(before, pp.wake_record(points, [16, 128, 256], 1.0, 5))
    assert after["factors"] == {**before["factors"], "wake_factor": pytest.approx(1.5),
                                "wake_overhead_s": pytest.approx(0.01)}
    assert after["note"] == "kept" and after["wake"]["idle_s"] == 1.0
    assert [x["tokens"] for x in after["wake"]["plans"]] == [16, 128, 256]
    path.write_text(json.dumps(after))
    p = Predictor(preset("tiny"), "cpu", profile=str(path))
    assert p.profile.wake_factor == pytest.approx(1.5) and p.profile.wake_overhead_s == pytest.approx(0.01)
    assert p.profile.step_overhead_s == 3e-3
    assert "1.500 x its time + 10.00 ms" in pp.wake_line(after["wake"])
    with pytest.raises(ValueError, match="wake_factor must be positive"):
        Profile(wake_factor=0.0)
    with pytest.raises(ValueError, match="wake_overhead_s must not be negative"):
        Profile(wake_overhead_s=-1e-3)


# ------------------------------------------------------------------------------------------- set-ups and fits
def _args(*argv):
    import argparse

    ns = argparse.Namespace(model=None, dtype=None, hardware="auto", out=None, samples=None)
    for flag, value in zip(argv[::2], argv[1::2]):
        setattr(ns, flag.lstrip("-"), value)
    pp.resolve_defaults(ns)
    return ns


def test_defaults_follow_the_machine_and_the_hardware_asked_for():
    import os

    from mnemojax.scheduling.predictor import PROFILE_DIR

    cpu = _args()  # the tests' device is a CPU
    assert (cpu.hardware, cpu.model, cpu.dtype) == ("cpu", "tiny", "float32")
    assert cpu.out == os.path.join(PROFILE_DIR, "cpu.json")
    h100 = _args("--hardware", "h100")
    assert (h100.model, h100.dtype, h100.out) == ("llama3.2-1b", "bfloat16", os.path.join(PROFILE_DIR, "h100.json"))
    mine = _args("--hardware", "h200", "--model", "llama3-8b", "--out", "/tmp/x.json")
    assert (mine.model, mine.dtype, mine.out) == ("llama3-8b", "bfloat16", "/tmp/x.json")
    with pytest.raises(SystemExit, match="'b200' is not a predictor preset; known: .*'h100'"):
        _args("--hardware", "b200")


def test_gpu_plans_fit_the_gpu_engine():
    """Every GPU plan runs on the GPU set-up as built: tokens within the budget, requests within max_num_seqs,
    contexts within max_model_len, the plan's keys within the page pool (no two requests share a page); and each
    category has plans to fit and to hold out."""
    setup = pp.SETUPS["gpu"]
    model = preset(setup.model)
    assert setup.max_model_len <= model.max_position_embeddings
    plans = pp.gpu_plans(0)
    usable = setup.num_pages - 1  # page 0 is the null page
    for _, chunks in plans:
        assert sum(c.query_tokens for c in chunks) <= setup.max_num_batched_tokens
        assert len(chunks) <= setup.max_num_seqs
        assert all(c.query_tokens <= c.context_len <= setup.max_model_len for c in chunks)
        assert sum(-(-c.context_len // setup.page_size) for c in chunks) <= usable
    train, held = pp.split(plans)
    kinds = {k for k, _ in plans}
    assert kinds == {"decode", "prefill", "mixed", "prefills"}
    assert {plans[i][0] for i in held} == kinds == {plans[i][0] for i in train}
    assert max(c.context_len for _, p in plans for c in p) == 131072
    assert pp.gpu_plans(0) == plans and pp.gpu_plans(1) != plans  # seeded


def test_fit_of_a_gpu_kernel_recovers_its_profile_and_leaves_reference_factors_alone():
    """Steps timed by a known profile of the Pallas kernels on an H100 (llama3.2-1b, bf16): the fit from the
    defaults finds factors predicting them within 2%, and does not move the factors only the reference kernel's
    cost uses (they cannot change a Pallas prediction)."""
    import dataclasses

    model = preset("llama3.2-1b")
    truth = Profile(attention="pallas", linear_flops_eff=0.55, linear_bw_eff=0.6, attn_flops_eff=0.3,
                    attn_bw_eff=0.45, step_overhead_s=4e-3, per_token_overhead_s=2e-7,
                    per_request_overhead_s=5e-6, per_row_overhead_s=1e-6)

    def make(profile):
        return Predictor(model, "h100", dtype_bytes=2, profile=profile)

    plans = [p for _, p in pp.gpu_plans(0)]
    times = [make(truth).step_time(p) for p in plans]
    base = Profile(attention="pallas", attn_gather_bw_eff=0.37, attn_block_overhead_s=1e-5)
    factors = pp.fitted_factors("pallas")
    assert set(pp.FITTED) - set(factors) == set(pp.REFERENCE_ONLY)
    got = pp.fit(make, base, plans, times, factors=factors)
    errs = [abs(make(got).step_time(p) / t - 1) for p, t in zip(plans, times)]
    assert max(errs) < 0.02
    assert (got.attn_gather_bw_eff, got.attn_block_overhead_s, got.attn_gather_cache_bytes) == (0.37, 1e-5, None)
    assert dataclasses.replace(got, **{k: getattr(base, k) for k in factors}) == base  # only `factors` moved
    assert pp.fitted_factors("reference") == pp.FITTED


def test_a_profile_with_the_older_wake_record_refits_from_its_samples(tmp_path, capsys):
    """`--samples` on a profile written before the wake overhead existed: its wake factor is kept, the overhead is
    0, and nothing is timed (the samples are the file's)."""
    path = tmp_path / "old.json"
    plans = pp.cpu_plans(0)
    truth = Predictor(preset("tiny"), "cpu", profile=Profile(attention="reference", step_overhead_s=2e-3))
    samples = [{"kind": k, "chunks": [[c.query_tokens, c.context_len, c.num_ranks] for c in p],
                "measured_s": truth.step_time(p), "held_out": i in pp.split(plans)[1]}
               for i, (k, p) in enumerate(plans)]
    truth.save_profile(str(path), model="tiny", engine={"block_tokens": 128}, timing={"command": "x", "date": "d",
                       "machine": ["m"], "reps": 1, "seconds": 1.0, "other_processes_cpu": 0.0},
                       wake={"idle_s": 1.0, "reps": 5, "factor": 1.3, "plans": []}, samples=samples)
    out = tmp_path / "new.json"
    result = pp.main(["--samples", str(path), "--out", str(out)])
    assert result["held_out"]["median"] < 0.02  # the reference kernel's cost model refitted to its own numbers
    factors = json.loads(out.read_text())["factors"]
    assert factors["wake_factor"] == 1.3 and factors["wake_overhead_s"] == 0.0
    assert "wake factor 1.300 after 1 s idle (measured by an older script)" in capsys.readouterr().out
