"""The deployment planner (`mnemojax.sim.planner`, `python -m mnemojax.plan`).

Feasibility rules with their reasons (none silently skipped), the ranking, the early stop (every candidate it
stops is really dominated, and the best is the same without it), the process pool (same results as one
process), the P99 lower bound it relies on, the command and its plots, the emitted serve command (parsed by the
server's real flag definitions, and a server started with it on fake CPU devices), and the notebook.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from absl import flags

from mnemojax.sim import planner
from mnemojax.sim.planner import SLO, Cluster, PlanConfig, SearchSpace, Workload
from mnemojax.sim.simulator import TraceRequest
from tests.server_utils import ROOT, ServeProcess, serve_env

PAGES = 1 + 4 * (4096 // 16)  # the engine's default KV pages for max_model_len 4096


def tiny_trace(n: int = 24, rate: float = 4.0, seed: int = 0) -> list[TraceRequest]:
    """Short prompts of 32-600 tokens and every 8th a long one of 3000, 8 output tokens each."""
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(1 / rate))
        out.append(TraceRequest(t, 3000 if i % 8 == 0 else int(rng.integers(32, 600)), 8))
    return out


def tiny_config(**space) -> PlanConfig:
    """The tiny model on fake CPU devices, priced with the shipped CPU profile."""
    kw = dict(tp="1,2", spp="1", kvp="1,2", chunk_size="256", target_batch_time_ms="50", num_pages=PAGES,
              max_num_batched_tokens="512", max_num_seqs=16)
    kw.update(space)
    return PlanConfig(model="tiny", dtype="float32", cluster=Cluster(hardware="cpu", num_gpus=4, gpus_per_host=4),
                      workload=Workload(long_threshold_tokens=2048),
                      slo=SLO(ttft_short_s=0.5, ttft_long_s=3.0, tbt_p99_ms=100.0),
                      space=SearchSpace(**kw), workers=1, progress=False, capacity_scales="")


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "sim_cpu_s"}


# ------------------------------------------------------------------------------------------------ feasibility
def test_infeasible_candidates_are_rejected_with_their_reason():
    long_trace = [TraceRequest(0.0, 1_000_000, 4), TraceRequest(1.0, 1000, 4)]
    cfg = PlanConfig(model="llama3-8b", cluster=Cluster(hardware="h100", num_gpus=8, gpus_per_host=4),
                     space=SearchSpace(tp="1,3,8", spp="1,16", kvp="1,2", replicas="1",
                                       max_tokens_per_kvp_rank="65536,none", target_batch_time_ms="30"),
                     workers=1, progress=False, capacity_scales="")
    setup = planner.resolve(cfg, long_trace)
    cands = planner.candidates(setup)
    reasons = {c: planner.infeasibility(c, setup) for c in cands}

    def why(**kw):
        [r] = [r for c, r in reasons.items() if all(getattr(c, k) == v for k, v in kw.items())]
        return r

    assert "does not divide the model's 32 attention heads" in why(tp=3, spp=1, kvp=1)
    assert "spans hosts" in why(tp=8, spp=1, kvp=1)
    assert "needs 16 devices" in why(tp=1, spp=16, kvp=1) and "the cluster has 8" in why(tp=1, spp=16, kvp=1)
    # A 1M-token request's KV (128 GiB at tp=1) fits no single H100 ...
    assert "can never fit" in why(tp=1, spp=1, kvp=1) and "KV pages" in why(tp=1, spp=1, kvp=1)
    # ... and a prompt longer than kvp x max_tokens_per_kvp_rank never fits its ranks.
    assert "exceeds kvp (2) x max_tokens_per_kvp_rank (65536)" in why(tp=1, spp=1, kvp=2,
                                                                       max_tokens_per_kvp_rank=65536)
    big = planner.resolve(dataclasses.replace(cfg, model="llama3-70b",
                                              space=SearchSpace(tp="1", spp="1", kvp="1", replicas="1",
                                                                target_batch_time_ms="30")), long_trace)
    [c] = planner.candidates(big)
    assert "does not fit in memory" in planner.infeasibility(c, big)
    # Nothing is dropped silently: every candidate is simulated, stopped or rejected with a reason.
    result = planner.plan(dataclasses.replace(cfg, space=SearchSpace(tp="3,8", spp="1", kvp="1", replicas="1")),
                          trace=long_trace)
    assert {o.candidate for o in result.outcomes} == set(planner.candidates(result.setup))
    assert all(o.reason for o in result.outcomes if o.status != "ok")


def test_tiny_model_rules_and_replicas():
    setup = planner.resolve(tiny_config(tp="1,3", spp="1,8"), tiny_trace())
    reasons = {c: planner.infeasibility(c, setup) for c in planner.candidates(setup)}
    assert all("spp (8) exceeds the model's 4 layers" in r for c, r in reasons.items() if c.spp == 8 and c.tp == 1)
    assert all("does not divide" in r for c, r in reasons.items() if c.tp == 3 and c.spp == 1)
    ok = [c for c, r in reasons.items() if r is None]
    # replicas "all": powers of two up to what fits, and the most that fit
    assert sorted({(c.gpus_per_replica, c.replicas) for c in ok}) == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)]
    # kvp > 1 with "auto": the longest request split evenly over the ranks, in whole pages
    assert {c.max_tokens_per_kvp_rank for c in ok if c.kvp == 2} == {-(-3008 // 32) * 16}


@pytest.mark.parametrize("num_gpus, per_host, per_replica, fit", [
    (24, 8, 12, 1),  # a replica of 12 takes 2 whole hosts of 8: one fits on 3 hosts (it planned 2)
    (24, 8, 3, 6),   # 2 of 3 devices per host, never one across two hosts (it planned 8)
    (16, 8, 3, 4),   # the review's x5 on 2 hosts
    (24, 8, 8, 3), (24, 8, 16, 1), (20, 8, 4, 5),  # a partial host of 4 holds one more
])
def test_replicas_fit_on_whole_hosts(num_gpus, per_host, per_replica, fit):
    cl = Cluster(hardware="h100", num_gpus=num_gpus, gpus_per_host=per_host)
    assert planner.replicas_that_fit(per_replica, cl) == fit


def test_replicas_that_do_not_fit_the_hosts_are_infeasible():
    cfg = PlanConfig(model="llama3-8b", cluster=Cluster(hardware="h100", num_gpus=24, gpus_per_host=8),
                     space=SearchSpace(tp="4", spp="3", kvp="1", replicas="1,2", target_batch_time_ms="30"),
                     workers=1, progress=False, capacity_scales="")
    setup = planner.resolve(cfg, [TraceRequest(0.0, 1000, 4)])
    reasons = {c.replicas: planner.infeasibility(c, setup) for c in planner.candidates(setup)}
    assert reasons[1] is None
    assert "2 replicas of 12 devices do not fit on hosts of 8 (24 devices): at most 1" in reasons[2]
    maxed = planner.resolve(dataclasses.replace(cfg, space=dataclasses.replace(cfg.space, replicas="max")),
                            [TraceRequest(0.0, 1000, 4)])
    assert {c.replicas for c in planner.candidates(maxed)} == {1}


# ------------------------------------------------------------------------------------------------ the search
@pytest.fixture(scope="module")
def searched():
    """One search with and one without the early stop, in this process."""
    cfg = tiny_config(target_batch_time_ms="25,100", scheduler_policy="fcfs,ilrs")
    trace = tiny_trace(40, rate=12.0)  # loaded: one device cannot keep up, more devices can
    return planner.plan(cfg, trace=trace), planner.plan(dataclasses.replace(cfg, early_stop=False), trace=trace)


def test_ranking_and_table(searched):
    result, _ = searched
    ranked = result.ranked
    assert ranked and ranked == sorted(ranked, key=planner._rank_key)
    meets = [o.meets_slo for o in ranked]
    assert meets == sorted(meets, reverse=True)  # every candidate meeting the SLOs before any that does not
    first = [o for o in ranked if o.meets_slo]
    assert [o.candidate.gpus for o in first] == sorted(o.candidate.gpus for o in first)
    for o in ranked:
        m = o.metrics
        assert m["requests"] == 40 and 0 <= m["attainment"] <= 1 and m["meets_slo"] == (m["attainment"] >= 0.99)
        assert m["goodput_rps"] == pytest.approx(m["within_slo"] / result.setup.window_s)
        assert 0 < m["kv_peak"] <= 1 and m["kv_pages_per_rank"] == PAGES
    table = result.table()
    assert "attain" in table and "goodput" in table and ranked[0].candidate.label.split()[0] in table
    report = result.report()
    assert "python -m mnemojax.serve" in report and "stopped early" in report


def test_early_stop_only_stops_dominated_candidates(searched):
    early, full = searched
    stopped = early.of_status("dominated")
    assert stopped, "the loaded trace should let cheap candidates stop some others"
    assert len(early.ranked) + len(stopped) == len(full.ranked)
    by_candidate = {o.candidate: o for o in full.ranked}
    position = {o.candidate: i for i, o in enumerate(full.ranked)}
    for o in stopped:  # its full simulation is dominated by one that finished, which ranks above it
        final = by_candidate[o.candidate].objectives()
        assert any(planner.dominates(f.objectives(), final) and position[f.candidate] < position[o.candidate]
                   for f in early.ranked), o
    assert early.best.candidate == full.best.candidate
    for o in early.ranked:  # a finished simulation is the same with or without the early stop
        assert _untimed(o.metrics) == _untimed(by_candidate[o.candidate].metrics)


def test_pool_of_workers_gives_the_same_results(searched):
    _, full = searched
    cfg = dataclasses.replace(full.config, workers=2, early_stop=False)
    pooled = planner.plan(cfg, trace=full.setup.trace)
    assert [(o.candidate, _untimed(o.metrics)) for o in pooled.ranked] == \
        [(o.candidate, _untimed(o.metrics)) for o in full.ranked]


def test_p99_lower_bound():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        values = rng.exponential(1.0, n)
        k = int(rng.integers(0, n + 1))
        known = rng.permutation(values)[:k] * rng.uniform(0.5, 1.0, k)  # lower bounds of k of the values
        lb = planner._p99_lower_bound(known, n)
        assert lb <= np.percentile(values, 99) + 1e-12
    assert planner._p99_lower_bound(np.arange(100.0), 100) == 98.0  # all known: the lower interpolation point


def test_dominates_and_pareto_front():
    assert planner.dominates((1, -2.0, 1.0), (1, -2.0, 2.0)) and not planner.dominates((1, -2.0), (1, -2.0))
    assert planner.dominates((1, None, 1.0), (2, 5.0, 1.0)) and not planner.dominates((2, 0.0), (1, 1.0))
    assert planner.pareto_front([(1, 5), (2, 3), (3, 4), (4, 1)]) == [(1, 5), (2, 3), (4, 1)]


# ------------------------------------------------------------------------------------------------ commands
def _serve_flags(argv) -> flags.FlagValues:
    from mnemojax.serving.server import define_serve_flags

    fv = flags.FlagValues()
    define_serve_flags(fv)
    fv(["serve", *argv])
    return fv


def test_serve_command_parses_with_the_servers_flags(searched):
    from mnemojax.cli import from_flags
    from mnemojax.engine.llm_engine import EngineConfig

    result, _ = searched
    for o in result.ranked[:3]:
        cmd = result.serve_command(o)
        assert cmd.env == () and cmd.processes == 1  # CPU: no XLA memory fraction; one host
        engine = from_flags(EngineConfig, _serve_flags(cmd.argv))
        c = o.candidate
        assert (engine.tp, engine.spp, engine.kvp) == (c.tp, c.spp, c.kvp)
        assert engine.max_tokens_per_kvp_rank == c.max_tokens_per_kvp_rank
        assert engine.scheduler_policy == c.scheduler_policy and engine.chunk_size == c.chunk_size
        assert engine.target_batch_time_ms == c.target_batch_time_ms and engine.hardware == "cpu"
        assert engine.num_pages == PAGES and engine.max_model_len == 3008 and engine.dtype == "float32"
        assert engine.ttft_slo_min_s == 0.5  # the scheduler's deadlines come from the SLOs
        assert engine.ttft_slo_min_s + engine.ttft_slo_per_token_s * 3000 == pytest.approx(3.0)
        assert "python -m mnemojax.serve" in cmd.shell()


def test_a_candidate_without_a_target_serves_without_predictor_flags():
    """Fixed chunks (target none): the server builds no predictor and refuses --hardware / --predictor_profile,
    so the command leaves them out (it wrote them, and the server then refused to start)."""
    from mnemojax.cli import from_flags
    from mnemojax.engine.llm_engine import EngineConfig

    setup = planner.resolve(tiny_config(tp="1", kvp="1", target_batch_time_ms="none", replicas="1"), tiny_trace())
    [c] = planner.candidates(setup)
    cmd = planner.serve_command(planner.simulate(c, setup), setup)
    engine = from_flags(EngineConfig, _serve_flags(cmd.argv))  # its checks pass
    assert engine.target_batch_time_ms is None and engine.hardware is None and engine.predictor_profile is None


def test_multi_host_and_gpu_commands_parse():
    trace = [TraceRequest(0.0, 200_000, 4), TraceRequest(0.5, 1000, 4)]
    cfg = PlanConfig(model="llama3-8b", cluster=Cluster(num_gpus=16), space=SearchSpace(
        tp="8", spp="1", kvp="2", replicas="1", target_batch_time_ms="30"), workers=1, progress=False,
        capacity_scales="", workload=Workload(output_tokens=4))
    setup = planner.resolve(cfg, trace)
    [c] = planner.candidates(setup)
    assert c.max_tokens_per_kvp_rank == 100_016  # 200,004 tokens over 2 ranks, in whole pages
    o = planner.simulate(c, setup)
    cmd = planner.serve_command(o, setup)
    assert cmd.processes == 2 and dict(cmd.env) == {"XLA_CLIENT_MEM_FRACTION": "0.95"}
    fv = _serve_flags(cmd.multi_host_argv("10.0.0.1:8476", 1))
    assert (fv.num_processes, fv.process_id, fv.kvp, fv.tp) == (2, 1, 2, 8)
    assert "--process_id=$PROCESS_ID" in cmd.shell() and cmd.shell().startswith("XLA_CLIENT_MEM_FRACTION=0.95 ")


def test_replicas_sharing_a_host_get_their_own_gpus_and_ports():
    from mnemojax.serving.config import ServerConfig

    assert planner.BASE_PORT == ServerConfig().port
    trace = [TraceRequest(0.0, 1000, 4), TraceRequest(0.5, 1000, 4)]
    cfg = PlanConfig(model="llama3-8b", cluster=Cluster(num_gpus=8, gpus_per_host=8), space=SearchSpace(
        tp="2", spp="1", kvp="1", replicas="4", target_batch_time_ms="30"), workers=1, progress=False,
        capacity_scales="", workload=Workload(output_tokens=4))
    setup = planner.resolve(cfg, trace)
    [c] = planner.candidates(setup)
    cmd = planner.serve_command(planner.simulate(c, setup), setup)
    assert cmd.replicas_per_host == 4 and cmd.processes == 1
    shells = cmd.shells()
    assert len(shells) == 4 == len(set(shells))
    for j, line in enumerate(shells):
        assert line.startswith(f"XLA_CLIENT_MEM_FRACTION=0.95 CUDA_VISIBLE_DEVICES={2 * j},{2 * j + 1} python ")
        fv = _serve_flags(cmd.replica_argv(j))
        assert (fv.port, fv.tp) == (8000 + j, 2)
    assert "4 per host" in cmd.describe()
    # a replica with a host to itself keeps the plain command
    one = planner.ServeCommand(cmd.argv, cmd.env, 2, 1, 1, 8, True)
    assert one.shells() == [one.shell()] and "CUDA_VISIBLE_DEVICES" not in one.shell() and "--port" not in one.shell()


def test_max_model_len_is_the_longest_request_not_rounded_to_pages():
    trace = [TraceRequest(0.0, 8186, 4), TraceRequest(0.5, 100, 4)]  # 8,190 tokens: fits llama3-8b's 8,192
    cfg = PlanConfig(model="llama3-8b", cluster=Cluster(num_gpus=1), space=SearchSpace(
        tp="1", spp="1", kvp="1", replicas="1", target_batch_time_ms="30"), workers=1, progress=False,
        capacity_scales="", workload=Workload(output_tokens=4))
    setup = planner.resolve(cfg, trace)
    assert setup.max_model_len == 8190 and not [n for n in setup.notes if "max_position_embeddings" in n]
    [c] = planner.candidates(setup)
    argv = planner.serve_command(planner.simulate(c, setup), setup).argv
    assert "--max_model_len=8190" in argv


def test_hf_directory_is_priced_as_the_preset_with_its_shapes(tmp_path):
    from models.config import preset

    d = tmp_path / "llama"
    d.mkdir()
    cfg = preset("tiny").to_hf_dict()
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama")))
    name, mc = planner.resolve_model(str(d))
    assert name == "tiny" and mc.hidden_size == 128
    (d / "config.json").write_text(json.dumps(dict(cfg, hidden_size=256, architectures=["LlamaForCausalLM"],
                                                   model_type="llama")))
    with pytest.raises(ValueError, match="no model preset has its shapes"):
        planner.resolve_model(str(d))


@pytest.mark.slow  # ~11 s on 2 cores: it starts a server process
def test_emitted_layout_starts_the_server_on_fake_cpu_devices(searched):
    result, _ = searched
    [o] = [o for o in result.ranked if (o.candidate.tp, o.candidate.kvp, o.candidate.replicas) == (2, 2, 1)][:1]
    with ServeProcess(list(result.serve_command(o).argv), num_cpu_devices=o.candidate.gpus_per_replica) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": [65] * 40, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "mesh kvp=2 spp=1 tp=2" in server.output, server.output[-2000:]


def test_plan_command_writes_the_table_and_plots(tmp_path):
    trace = tmp_path / "trace.jsonl"
    from mnemojax.sim.simulator import save_trace

    save_trace(tiny_trace(16), str(trace))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mnemojax.plan", "--model=tiny", "--dtype=float32", "--hardware=cpu",
         "--num_gpus=2", "--gpus_per_host=2", f"--trace={trace}", "--long_threshold_tokens=2048",
         "--ttft_short_s=0.5", "--ttft_long_s=3", "--tbt_p99_ms=100", "--tp=1", "--spp=1", "--kvp=1,2",
         "--chunk_size=256", f"--num_pages={PAGES}", "--max_num_batched_tokens=512", "--max_num_seqs=16",
         "--workers=1", "--capacity_scales=0.5,2", "--top=2", f"--output_dir={out}", "--noprogress"],
        cwd=ROOT, env=serve_env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "goodput" in proc.stdout and "python -m mnemojax.serve --model=tiny" in proc.stdout
    saved = json.loads((out / "plan.json").read_text())
    assert saved["requests"] == 16 and len(saved["capacity"]) == 2
    assert all(len(pts) == 3 for pts in saved["capacity"].values())  # rates x0.5, x1, x2
    for png in ("pareto.png", "capacity.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "mnemojax.plan", "--tp=x"], cwd=ROOT, env=serve_env(1),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "tp: expected comma-separated integers" in bad.stderr


@pytest.mark.slow
def test_plan_notebook_runs():
    """docs/notebooks/plan.ipynb (8 and 64 H100s, their plots) runs top to bottom; about a minute on 2 cores."""
    import nbclient
    import nbformat

    from tests.test_notebook import ThisPythonKernelManager

    nb = nbformat.read(os.path.join(ROOT, "docs", "notebooks", "plan.ipynb"), as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code"), "save the notebook with its outputs cleared"
    client = nbclient.NotebookClient(nb, kernel_name="python3", kernel_manager_class=ThisPythonKernelManager,
                                     timeout=600, startup_timeout=120, resources={"metadata": {"path": ROOT}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert text.count("python -m mnemojax.serve") == 2 and "attain" in text and "TTFT 1M" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # Pareto and capacity, twice


@pytest.mark.slow
def test_validation_replays_the_planned_command_on_the_engine():
    """scripts/validate_plan.py's machinery on a few requests: the plan's serve command becomes the engine's config,
    every shape bucket compiles first, and the measured percentiles sit beside the predicted ones."""
    from mnemojax.bench import plan_validation as pv

    trace = pv.validation_trace(6, 4.0, seed=3)
    rec = pv.validate_layout(1, 1, 1, trace)
    assert rec["devices"] == 1 and rec["candidate"].startswith("tp1 spp1 kvp1")
    measured = {k: m for k, _, m, _ in rec["rows"]}
    assert measured["ttft_p50_all_s"] > 0 and measured["tbt_p50_ms"] > 0
    assert "python -m mnemojax.serve --model=tiny" in pv.format_layout(rec)
