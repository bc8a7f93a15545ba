"""The simulator: it drives the engine's real Scheduler and KVCacheManager with the predictor as the clock.

Completion and page accounting on a light trace, determinism, the metrics JSON, JSONL traces, the clocked
pipeline (K chunks alone take K + spp - 1 steps, and the predictor's own prefill time), rejection of requests
that can never fit, KV parallelism, and ILRS beating FCFS on short requests' TTFT behind a long prompt.
"""
import json
import os
import subprocess
import sys

import pytest

from mnemojax.sim import simulator
from mnemojax.scheduling.kv_manager import KVCacheManager
from mnemojax.scheduling.predictor import Predictor
from mnemojax.scheduling.scheduler import Scheduler
from mnemojax.sim.simulator import SimConfig, Simulator, TraceRequest
from tests import REPO

ROOT = REPO


def _light_trace():
    return simulator.synthetic_trace(2.0, 10.0, seed=3)


def _without_timing(m):
    return {k: v for k, v in m.items() if k not in ("wall_s", "cpu_s")}


def test_drives_the_real_scheduler_and_page_manager(monkeypatch):
    calls = []
    real = Scheduler.schedule

    def counting(self, now=None):
        calls.append(now)
        return real(self, now)

    monkeypatch.setattr(Scheduler, "schedule", counting)
    sim = Simulator(SimConfig(), _light_trace())
    assert type(sim.scheduler) is Scheduler and type(sim.kv) is KVCacheManager
    assert sim.scheduler.kv is sim.kv and type(sim.predictor) is Predictor
    assert sim.scheduler.predictor is sim.predictor  # a target batch time: the scheduler uses the same clock
    res = sim.run()
    assert len(calls) >= res.metrics["steps"] > 0
    assert calls == sorted(calls)  # the simulated clock is what the scheduler sees, and it never goes back


def test_light_trace_completes_and_pages_drain():
    trace = _light_trace()
    sim = Simulator(SimConfig(), trace)
    m = sim.run().metrics
    assert m["completed"] == len(trace) == m["num_requests"] and m["unfinished"] == 0 and m["rejected"] == 0
    assert m["stop_reason"] == "done"
    assert sim.kv.num_used == 0 and sim.scheduler.num_unfinished == 0
    assert m["short"]["ttft_p50"] > 0 and m["short"]["tbt_p50"] > 0
    assert m["throughput_tokens_per_s"] > 0


def test_deterministic_for_a_seed():
    a = simulator.synthetic_trace(1.0, 30.0, long_fraction=0.2, long_min_tokens=20_000, long_max_tokens=60_000,
                                  seed=7)
    b = simulator.synthetic_trace(1.0, 30.0, long_fraction=0.2, long_min_tokens=20_000, long_max_tokens=60_000,
                                  seed=7)
    c = simulator.synthetic_trace(1.0, 30.0, long_fraction=0.2, long_min_tokens=20_000, long_max_tokens=60_000,
                                  seed=8)
    assert a == b and a != c
    assert any(t.prompt_tokens > 8192 for t in a)
    r1, r2 = simulator.simulate(SimConfig(), a), simulator.simulate(SimConfig(), b)
    assert _without_timing(r1.metrics) == _without_timing(r2.metrics)
    assert r1.requests == r2.requests and r1.timeline == r2.timeline


def test_synthetic_trace_shape():
    t = simulator.synthetic_trace(20.0, 200.0, seed=0)  # ~4000 short requests
    prompts = sorted(r.prompt_tokens for r in t)
    assert 3600 < len(t) < 4400
    assert all(r.prompt_tokens + r.output_tokens <= simulator.SHORT_MAX_TOKENS for r in t)
    assert 1400 < prompts[len(prompts) // 2] < 1900  # ShareGPT4's median prompt is 1730 (before the 8K cap)
    arrivals = [r.arrival_time for r in t]
    assert arrivals == sorted(arrivals) and arrivals[-1] < 200.0
    long = simulator.synthetic_trace(20.0, 200.0, long_fraction=1.0, long_min_tokens=131072,
                                     long_max_tokens=1048576, seed=0)
    assert all(131072 <= r.prompt_tokens <= 1048576 for r in long)


def test_metrics_json_has_the_required_keys(tmp_path):
    res = simulator.simulate(SimConfig(scheduler_policy="edf"), _light_trace())
    path = tmp_path / "out.json"
    res.to_json(str(path))
    d = json.loads(path.read_text())
    for key in ("policy", "completed", "short", "long", "throughput_tokens_per_s", "rejected", "simulated_s",
                "steps", "wall_s", "num_requests", "requests"):
        assert key in d, key
    assert d["policy"] == "edf"
    for kind in ("short", "long"):
        assert {"ttft_p50", "ttft_p90", "ttft_p99", "tbt_p50", "tbt_p90", "tbt_p99"} <= set(d[kind])
    assert d["long"]["ttft_p50"] is None  # no long requests: null, not a made-up number
    assert len(d["requests"]) == d["completed"] and all(r["ttft"] > 0 for r in d["requests"])


def test_jsonl_trace_round_trip(tmp_path):
    trace = simulator.synthetic_trace(1.0, 20.0, long_fraction=0.3, seed=1)
    path = str(tmp_path / "trace.jsonl")
    simulator.save_trace(trace, path)
    assert simulator.load_trace(path) == trace
    with open(path) as f:
        first = json.loads(f.readline())
    assert set(first) == {"arrival_time", "prompt_tokens", "output_tokens"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_time": 0.0, "prompt_tokens": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        simulator.load_trace(str(bad))
    with pytest.raises(ValueError, match="prompt_tokens"):
        TraceRequest(0.0, 0, 5)
    # a bad value names its line and its field; so does a line that is not JSON
    good = '{"arrival_time": 0.0, "prompt_tokens": 5, "output_tokens": 2}\n'
    for line, field in [('{"arrival_time": 1.0, "prompt_tokens": 8, "output_tokens": 2, "prefix_id": "doc-a", '
                         '"prefix_tokens": 4}', "prefix_id"),
                        ('{"arrival_time": "soon", "prompt_tokens": 8, "output_tokens": 2}', "arrival_time"),
                        ('{"arrival_time": 1.0, "prompt_tokens": 8, "output_tokens": 0}', "output_tokens"),
                        ("{arrival_time: 1}", "not JSON")]:
        bad.write_text(good + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{field}"):
            simulator.load_trace(str(bad))
    with pytest.raises(ValueError, match="prefix_id must be an integer"):
        TraceRequest(0.0, 8, 2, True, 4)


def test_trace_priorities_order_the_priority_policy_and_need_it(tmp_path):
    """A trace's `priority` (vLLM's): saved and loaded (only where it is not 0); under scheduler_policy priority,
    eight 20K-token prompts arriving together start by priority, so every priority-0 request's first token comes
    before any priority-1 request's, interleaved as they arrived; another policy refuses such a trace."""
    trace = [TraceRequest(0.0, 20_000, 4, priority=i % 2) for i in range(8)]
    path = str(tmp_path / "trace.jsonl")
    simulator.save_trace(trace, path)
    assert simulator.load_trace(path) == trace
    with open(path) as f:
        assert [set(json.loads(line)) - {"arrival_time", "prompt_tokens", "output_tokens"} for line in f][:2] == [
            set(), {"priority"}]
    res = simulator.simulate(SimConfig(scheduler_policy="priority"), trace)
    assert res.metrics["completed"] == 8
    ttft = {p: [r["ttft"] for r in res.requests if r["priority"] == p] for p in (0, 1)}
    assert len(ttft[0]) == len(ttft[1]) == 4 and max(ttft[0]) < min(ttft[1])
    with pytest.raises(ValueError, match="need scheduler_policy 'priority'.*'ilrs'"):
        Simulator(SimConfig(), trace)
    with pytest.raises(ValueError, match="priority must be an integer"):
        TraceRequest(0.0, 8, 2, priority=0.5)


@pytest.mark.parametrize("spp", [1, 2, 4])
def test_pipeline_prefill_takes_k_plus_s_minus_1_steps(spp):
    """A 64K-token prompt alone in chunks of 4096 (K = 16): its first token comes after K + spp - 1 clocked
    steps, at exactly the predictor's `prefill_time`; its decode tokens then come spp steps apart."""
    c, k = 4096, 16
    cfg = SimConfig(spp=spp, target_batch_time_ms=None, chunk_size=c, max_num_batched_tokens=c)
    sim = Simulator(cfg, [TraceRequest(0.0, k * c, 3)])
    res = sim.run()
    (r,) = res.requests
    assert r["first_token_step"] == k + spp - 1
    assert r["ttft"] == pytest.approx(sim.predictor.prefill_time(k * c, c), rel=1e-12)
    assert res.metrics["steps"] == k + spp - 1 + 2 * spp  # two more tokens, each a full trip through the pipeline
    assert sim.kv.num_used == 0


def test_pipeline_prefill_time_with_a_partial_last_chunk():
    """Clocked pipeline, spp = 2, chunks c1..c4 with c4 partial: the steps cost st1, st2, st3, max(st3, st4),
    st4 (each the slowest micro-batch in flight) - not st1 + st2 + st3 + st4 + st4, what `prefill_time` sums."""
    c = 4096
    cfg = SimConfig(spp=2, target_batch_time_ms=None, chunk_size=c, max_num_batched_tokens=c)
    sim = Simulator(cfg, [TraceRequest(0.0, 3 * c + 100, 1)])
    ttft = sim.run().requests[0]["ttft"]
    assert ttft == pytest.approx(sim.predictor.prefill_time(3 * c + 100, c), rel=1e-9)


def test_prefill_time_falls_with_spp():
    one = SimConfig(spp=1, target_batch_time_ms=None, chunk_size=4096, max_num_batched_tokens=4096)
    trace = [TraceRequest(0.0, 128 * 1024, 1)]
    t1 = simulator.simulate(one, trace).requests[0]["ttft"]
    t4 = simulator.simulate(SimConfig(**{**one.__dict__, "spp": 4}), trace).requests[0]["ttft"]
    assert 2.5 < t1 / t4 < 4.0  # near-linear (Medha's Figure 9), less the pipeline fill and per-stage overheads


def test_requests_that_can_never_fit_are_rejected():
    trace = [TraceRequest(0.0, 1000, 10), TraceRequest(0.1, 5000, 10), TraceRequest(0.2, 800, 10)]
    sim = Simulator(SimConfig(num_pages=101), trace)  # 100 usable pages of 16 tokens
    res = sim.run()
    m = res.metrics
    assert m["rejected"] == 1 and m["short"]["rejected"] == 1 and m["completed"] == 2 and m["unfinished"] == 0
    assert [r["prompt_tokens"] for r in res.requests if r["rejected"]] == [5000]
    assert sim.kv.num_used == 0


@pytest.mark.parametrize("policy", ["fcfs", "ilrs"])
def test_memory_pressure_preempts_and_still_completes(policy):
    # 64 usable pages = 1024 tokens; three requests of 300 + 200 tokens fit their prompts but not their outputs.
    trace = [TraceRequest(0.01 * i, 300, 200) for i in range(3)]
    sim = Simulator(SimConfig(num_pages=65, scheduler_policy=policy), trace)
    m = sim.run().metrics
    assert m["preemptions"] >= 1 and m["completed"] == 3 and m["stop_reason"] == "done"
    assert sim.kv.num_used == 0


def test_kv_pages_from_device_memory():
    # Llama-3-8B on a DGX-H100 (tp=8): ~4.4M tokens of KV per rank (Medha Figure 2: memory binds at ~4M).
    pages = simulator.kv_pages_per_rank(SimConfig(model="llama3-8b", hardware="h100", tp=8))
    assert 3.5e6 < pages * 16 < 5e6
    # Four pipeline stages hold a quarter of the layers each: about 4x the tokens.
    pages4 = simulator.kv_pages_per_rank(SimConfig(model="llama3-8b", hardware="h100", tp=8, spp=4))
    assert 3.9 < pages4 / pages < 4.3


def test_kvp_request_spans_ranks_and_drains():
    cfg = SimConfig(kvp=2, max_tokens_per_kvp_rank=32768)
    trace = [TraceRequest(0.0, 50_000, 4), TraceRequest(0.5, 2000, 8), TraceRequest(0.6, 3000, 8)]
    sim = Simulator(cfg, trace)
    seen = []
    real = sim.scheduler.update_from_output

    def spy(plan, outputs, now=None):
        seen.extend(len(ch.request.kv_ranks) for ch in plan.chunks)
        return real(plan, outputs, now)

    sim.scheduler.update_from_output = spy
    m = sim.run().metrics
    assert m["completed"] == 3 and max(seen) == 2
    assert sim.kv.num_used == 0


def test_horizon_reports_unfinished_with_ttft_lower_bound():
    cfg = SimConfig(target_batch_time_ms=None, chunk_size=1024, max_num_batched_tokens=1024, max_simulated_s=1.0)
    res = simulator.simulate(cfg, [TraceRequest(0.0, 200_000, 4)])
    m = res.metrics
    assert m["stop_reason"] == "horizon" and m["unfinished"] == 1 and m["completed"] == 0
    assert m["long"]["no_first_token"] == 1
    assert m["long"]["ttft_p50"] == pytest.approx(m["simulated_s"]) and m["simulated_s"] >= 1.0


def test_horizon_counts_from_the_first_arrival():
    """max_simulated_s is simulated seconds from the first arrival (the clock starts there): a trace starting at
    t = 100 with a horizon of 50 was cut before its first step (TTFT 0 reported, its second request missing).
    Shifted by 100 s, the same trace gives the same metrics; a request arriving after the horizon is counted."""
    cfg = SimConfig(target_batch_time_ms=None, chunk_size=1024, max_num_batched_tokens=1024, max_simulated_s=1.0)

    def run(t0):
        trace = [TraceRequest(t0, 200_000, 4), TraceRequest(t0 + 0.5, 300, 4), TraceRequest(t0 + 5.0, 300, 4)]
        return simulator.simulate(cfg, trace).metrics

    late, early = run(100.0), run(0.0)
    assert late["stop_reason"] == "horizon" and late["steps"] > 0 and late["not_arrived"] == 1
    keys = ("steps", "completed", "unfinished", "not_arrived", "simulated_s")
    assert {k: late[k] for k in keys} == pytest.approx({k: early[k] for k in keys})
    assert late["long"]["ttft_p50"] == pytest.approx(early["long"]["ttft_p50"]) and late["long"]["ttft_p50"] > 0.9


@pytest.mark.parametrize("field", ["qps", "duration_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0])
def test_workload_rates_and_durations_are_finite(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
        simulator.Workload(**{field: value})  # an infinite one made the synthetic mix loop for ever


def test_trace_times_and_lengths_are_no_booleans():
    with pytest.raises(ValueError, match="arrival_time"):
        TraceRequest(True, 5, 5)
    with pytest.raises(ValueError, match="prefix_tokens"):
        TraceRequest(0.0, 5, 5, 3, True)


def _mixed_trace():
    """A 256K-token prompt at t = 0, then 24 short requests (1000-token prompts) every 0.25 s."""
    return [TraceRequest(0.0, 256 * 1024, 8)] + [TraceRequest(0.5 + 0.25 * i, 1000, 16) for i in range(24)]


def test_ilrs_beats_fcfs_on_short_ttft_behind_a_long_prompt():
    m = {p: simulator.simulate(SimConfig(scheduler_policy=p), _mixed_trace()).metrics for p in ("fcfs", "ilrs")}
    fcfs, ilrs = m["fcfs"]["short"]["ttft_p50"], m["ilrs"]["short"]["ttft_p50"]
    # FCFS: the short requests wait behind the long prefill (seconds); ILRS preempts it at chunk boundaries.
    assert fcfs > 1.0 and ilrs < 0.5 and fcfs > 10 * ilrs
    assert m["fcfs"]["completed"] == m["ilrs"]["completed"] == 25


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install -e '.[sim]')")
    res = simulator.simulate(SimConfig(), _mixed_trace(), plot_dir=str(tmp_path))
    for name in ("ttft_cdf.png", "active_requests.png"):
        assert (tmp_path / name).stat().st_size > 1000
    both = simulator.plot_ttft_cdfs({"a": res, "b": res}, str(tmp_path / "cmp.png"))
    assert os.path.getsize(both) > 1000


def test_cli_writes_json(tmp_path):
    out = tmp_path / "m.json"
    trace = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, "-m", "mnemojax.sim", "--qps=2", "--duration_s=5", "--scheduler_policy=lrs",
                           f"--output_json={out}", f"--save_trace={trace}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "lrs" in proc.stdout and json.loads(out.read_text())["policy"] == "lrs"
    assert len(simulator.load_trace(str(trace))) == json.loads(out.read_text())["num_requests"] > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_after_idling_takes_the_wake_factor(async_scheduling):
    """wake_factor 2: a step launched when the device sat idle (the first, and the first after a gap) takes twice
    its time, so the TTFT of a request arriving at an idle engine doubles; the steps that follow others (the
    decodes, a request joining a busy engine) keep their time."""
    import dataclasses

    trace = [TraceRequest(0.0, 100, 4), TraceRequest(0.001, 60, 4), TraceRequest(50.0, 100, 4)]
    runs = {}
    for wake in (1.0, 2.0):
        cfg = SimConfig(async_scheduling=async_scheduling)
        predictor = simulator.make_predictor(cfg)
        predictor.set_profile(dataclasses.replace(predictor.profile, wake_factor=wake))
        runs[wake] = Simulator(cfg, trace, predictor=predictor).run().requests
    warm, cold = runs[1.0], runs[2.0]
    for i in (0, 2):  # alone at an idle engine: one prefill step, twice as long
        assert cold[i]["ttft"] == pytest.approx(2 * warm[i]["ttft"], rel=1e-12)
        assert cold[i]["tbt_max"] == pytest.approx(warm[i]["tbt_max"], rel=1e-12)
    # the second request joins while the first's prefill runs: it waits for that step's extra time only
    assert cold[1]["first_token"] - warm[1]["first_token"] == pytest.approx(warm[0]["ttft"], rel=1e-12)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_after_idling_takes_the_wake_overhead_on_top(async_scheduling):
    """wake_factor 1.5 and wake_overhead_s 7 ms: a step launched on an idle device takes 1.5 x its time + 7 ms (the
    host's wake-up), so a request alone at an idle engine gets its first token that much later; later steps keep
    their time."""
    import dataclasses

    trace = [TraceRequest(0.0, 100, 4), TraceRequest(50.0, 100, 4)]
    runs = {}
    for wake in ((1.0, 0.0), (1.5, 0.007)):
        cfg = SimConfig(async_scheduling=async_scheduling)
        predictor = simulator.make_predictor(cfg)
        predictor.set_profile(dataclasses.replace(predictor.profile, wake_factor=wake[0], wake_overhead_s=wake[1]))
        runs[wake] = Simulator(cfg, trace, predictor=predictor).run().requests
    warm, cold = runs[(1.0, 0.0)], runs[(1.5, 0.007)]
    for i in (0, 1):
        assert cold[i]["ttft"] == pytest.approx(1.5 * warm[i]["ttft"] + 0.007, rel=1e-12)
        assert cold[i]["tbt_max"] == pytest.approx(warm[i]["tbt_max"], rel=1e-12)
