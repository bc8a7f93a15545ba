"""The GPU benchmark scripts (scripts/bench_attention.py, scripts/bench_step.py) end to end in their --small mode:
tiny shapes, interpreted kernels, on the CPU. Checks that they run, measure something and print the command,
the hardware and the table last; the numbers themselves mean something only on a GPU."""
import importlib.util
import math

import jax
import numpy as np
import pytest

from models.attention import dense_attention_reference
from tests import REPO

REPO = REPO


def _script(name):
    return importlib.import_module(f"mnemojax.bench.{name.removeprefix('bench_')}")


@pytest.mark.slow  # ~11 s: the default suite reached 10:11 in a fresh clone on this VM (2026-11-24)
def test_bench_attention_small(capsys):
    res = _script("bench_attention").main(["--small"])
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    assert lines[0] == "command: bench_attention.py --small" and lines[1].startswith("device: cpu")
    assert [r["chunk"] for r in res["prefill"]] == [4, 16, 64]
    for r in res["prefill"]:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["gbps"] > 0 and r["total_s"] > 0
    assert res["prefill"][-1]["total_vs_ref"] == 1.0  # chunk 64 is the reference chunk of --small
    f7 = res["figure7"][0]
    assert (f7["context"], f7["small"], f7["ref"]) == (256, 4, 64) and f7["total"] > 0 and f7["per_token"] > 0
    assert [(r["context"], r["batch"]) for r in res["decode"]] == [(256, 1), (256, 3)]
    assert all(r["ms"] > 0 and r["base"]["cudnn"] == (None, "no GPU") for r in res["decode"])
    assert lines[-1].split()[:2] == ["256", "3"]  # the decode table is last


@pytest.mark.slow  # ~15 s (interpreted kernels, twice): keeps the default suite under 10 minutes
def test_bench_attention_times_the_persistent_grid_beside_the_static_one(capsys):
    """--persistent: each Triton implementation named gets a second set of rows on its work-list grid, in the
    same run; naming no Triton implementation is refused."""
    res = _script("bench_attention").main(["--small", "--persistent", "--chunks", "4,64", "--decode_batches", "1"])
    out = capsys.readouterr().out
    impls = ["pallas_interpret", "pallas_interpret+persistent"]
    assert [(r["impl"], r["chunk"]) for r in res["prefill"]] == [(i, c) for i in impls for c in (4, 64)]
    assert [r["impl"] for r in res["decode"]] == impls and all(r["ms"] > 0 for r in res["decode"])
    assert "attention (pallas_interpret+persistent)" in out and "decode (pallas_interpret+persistent)" in out
    args = _script("bench_attention").parse_args(["--small", "--persistent"])
    layers = [_script("bench_attention").PagedLayer(args, 64, impl=i) for i in impls]
    assert [layer.plan_opts.get("persistent") for layer in layers] == [None, True]
    with pytest.raises(SystemExit):
        _script("bench_attention").main(["--small", "--impl", "reference", "--persistent"])
    assert "--persistent: the persistent grid is the Triton kernels'" in capsys.readouterr().err


@pytest.mark.slow  # ~7 s on 2 cores: a benchmark script's smoke run (its helpers' tests stay in the default suite)
def test_bench_attention_reports_a_failing_implementation_and_times_the_others(capsys, monkeypatch):
    """An implementation that raises (a kernel that does not compile on the device, say) is reported with its
    error, in its progress line and before its tables, and the implementations after it are still timed."""
    mod = _script("bench_attention")
    real_time = mod.PagedLayer.time

    def time(self, chunk, context, repeats):
        if self.impl == "pallas_interpret":
            raise RuntimeError("no kernel for you\nsecond line")
        return real_time(self, chunk, context, repeats)

    monkeypatch.setattr(mod.PagedLayer, "time", time)
    res = mod.main(["--small", "--impl", "pallas_interpret,reference", "--chunks", "4,16", "--decode_batches", "1"])
    out = capsys.readouterr().out
    assert res["errors"] == {"pallas_interpret": "RuntimeError: no kernel for you"}
    assert "pallas_interpret context 256: failed: RuntimeError: no kernel for you" in out
    assert "pallas_interpret: failed, not timed: RuntimeError: no kernel for you" in out
    assert [(r["impl"], r["chunk"]) for r in res["prefill"]] == [("reference", 4), ("reference", 16)]
    assert [r["impl"] for r in res["decode"]] == ["reference"] and res["decode"][0]["ms"] > 0


@pytest.mark.slow  # ~15 s (interpreted kernels, twice): keeps the default suite under 10 minutes
def test_bench_step_runs_the_persistent_grid(capsys):
    """--attention pallas_interpret+persistent: the model's spec asks the kernels for the persistent grid, and a
    prefill step on it gives the static grid's greedy token and cache; a persistent label on a kernel without
    the grid is refused."""
    step = _script("bench_step")
    args = step.parse_args(["--small", "--attention", "pallas_interpret,pallas_interpret+persistent"])
    models = [step.Model("tiny", args, 64, impl) for impl in args.impls]
    assert [m.spec.attention_options for m in models] == [(), (("persistent", True),)]
    assert {m.spec.attention for m in models} == {"pallas_interpret"}
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 256, 40)]
    got = [int(m.run(m.batch(tokens, 0))[0, 0]) for m in models]
    assert got[0] == got[1]
    np.testing.assert_array_equal(np.asarray(models[0].k), np.asarray(models[1].k))
    with pytest.raises(SystemExit):
        step.parse_args(["--small", "--attention", "reference+persistent"])
    assert "the persistent grid is the Triton kernels'" in capsys.readouterr().err


@pytest.mark.slow  # ~11 s, as above
def test_bench_step_small(capsys):
    """Two attention implementations in one run: rows of each, in the order given, then the exact long runs."""
    res = _script("bench_step").main(["--small", "--attention", "pallas_interpret,reference"])
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    assert lines[0] == "command: bench_step.py --small --attention pallas_interpret,reference"
    assert lines[1].startswith("device: cpu")
    assert res["ceiling"] > 0 and res["bandwidth"] > 0
    assert [(r["impl"], r["kind"], r["context"], r["tokens"]) for r in res["rows"]] == [
        (impl, kind, ctx, tokens) for impl in ("pallas_interpret", "reference")
        for kind, ctx, tokens in (("prefill", 192, 64), ("decode", 64, 1), ("decode", 320, 1))]
    assert all(r["ms"] > 0 and math.isfinite(r["util"]) and r["util"] > 0 for r in res["rows"])
    assert sorted(res["longs"]) == ["pallas_interpret", "reference"] and res["long"] is res["longs"]["pallas_interpret"]
    for long in res["longs"].values():
        assert (long["tokens"], long["chunk"], long["decoded"]) == (256, 64, 4)
        assert long["ttft_s"] > 0 and long["tbt_ms"] > 0
    table = [line.split() for line in lines if line.startswith(("pallas_interpret ", "reference "))]
    assert [row[:3] for row in table] == [[impl, kind, ctx] for impl in ("pallas_interpret", "reference")
                                          for kind, ctx in (("prefill", "192"), ("decode", "64"), ("decode", "320"))]
    assert all(row[-1] == "1.00x" for row in table[:3])  # the first implementation is the ratios' reference
    assert lines[-1].startswith("tiny, attention=reference: exact prefill of 256 tokens")
    # each TTFT printed as soon as measured, before its decode and the tables (a run stopped meanwhile keeps it)
    progress = [i for i, line in enumerate(lines)
                if line.startswith("  ") and " exact prefill of 256 tokens in chunks of 64: TTFT " in line]
    assert [lines[i].split()[0] for i in progress] == ["pallas_interpret", "reference"]
    assert progress[-1] < next(i for i, line in enumerate(lines) if line.startswith("pallas_interpret "))


def test_baseline_split_is_bottom_right_causal():
    """The cuDNN baseline's history + chunk split (run here with jax's XLA implementation) equals dense
    bottom-right causal attention."""
    split = _script("bench_attention").split_causal_attention
    rng = np.random.default_rng(0)
    c, n, N, K, H = 5, 23, 4, 2, 8
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, c, N, H), (1, n, K, H), (1, n, K, H)))
    want, _ = dense_attention_reference(q[0], k[0], v[0], np.arange(n - c, n), np.arange(n))
    with jax.default_matmul_precision("highest"):
        got = split(q, k, v)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_bytes_count_out_in_the_dtype_each_kernel_writes():
    """GB/s counts K/V once, q once and out once: bf16 out from the kernels (Triton and Mosaic), float32 from the
    reference."""
    from argparse import Namespace

    from mnemojax.bench.attention import attn_bytes

    args = Namespace(num_heads=32, num_kv_heads=8, head_dim=128)
    kv, q = 2 * 32768 * 8 * 128 * 2, 2048 * 32 * 128 * 2
    assert attn_bytes(args, 2, 2048, 32768, impl="pallas") == kv + q + 2048 * 32 * 128 * 2
    assert attn_bytes(args, 2, 2048, 32768, impl="reference") == kv + q + 2048 * 32 * 128 * 4
    assert attn_bytes(args, 2, 2048, 32768, impl="mosaic") == kv + q + 2048 * 32 * 128 * 2
    assert attn_bytes(args, 2, 1, 32768, batch=4, impl="mosaic_interpret") == 4 * (kv + 32 * 128 * 4)


def test_labels_carry_kernel_options_to_the_plan_or_to_each_layer():
    """An --impl label's options (`impl+name=value`): tiling options go to the step's plan, code-generation options
    to every layer's call; malformed labels and unknown implementations are refused by name."""
    mod = _script("bench_attention")
    assert mod.split_label("pallas+persistent") == ("pallas", {"persistent": True})
    assert mod.split_label("mosaic+consumers=1+approx_math=false") == ("mosaic", {"consumers": 1,
                                                                                 "approx_math": False})
    for bad in ("mosaic+fast", "mosaic+consumers=two"):
        with pytest.raises(ValueError, match=bad.split("+")[1].split("=")[0]):
            mod.split_label(bad)
    args = mod.parse_args(["--small", "--impl", "mosaic_interpret+consumers=1+lookahead=false"])
    layer = mod.PagedLayer(args, 64, impl=args.impls[0])
    assert (layer.impl, layer.plan_opts, layer.call_opts) == ("mosaic_interpret", {"consumers": 1},
                                                              {"lookahead": False})
    with pytest.raises(SystemExit):
        mod.parse_args(["--small", "--impl", "mosaic+persistent"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--small", "--impl", "flash"])
    # the step's kind, as the engine gives it: chunks are prefills, one-token sequences decodes
    assert [mod.step_kind(c) for c in (1, 2, 2048)] == ["decode", "prefill", "prefill"]


def test_median_time_per_call_of_calls_back_to_back():
    """--calls N: each sample runs the function N times and waits once; the time is per call (a host-side function
    whose duration is known stands in for the device)."""
    import time as _time

    mod = _script("bench_attention")
    count = []

    def fn():
        count.append(1)
        _time.sleep(0.002)
        return jax.numpy.zeros(())

    waits = []
    per_call = mod.median_time(fn, repeats=3, calls=5, wait=waits.append)
    assert len(count) == 1 + 3 * 5  # the warm-up, then 3 samples of 5 calls
    assert len(waits) == 1 + 3  # one wait for the warm-up and one per sample (torch's baseline waits this way too)
    assert 0.002 <= per_call < 0.009  # per call: a sample of 5 takes at least 0.010
    args = mod.parse_args(["--small", "--calls", "4"])
    assert args.calls == 4


class _FakeClock:
    """A clock that moves only when a timed function runs: `fn(name, seconds)` is a function that advances it by
    `seconds` and logs `name`, so each sample's time is known exactly."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def __call__(self):
        return self.now

    def fn(self, name, seconds):
        def run():
            self.now += seconds
            self.log.append(name)
            return name
        return run


def test_paired_times_take_one_sample_of_each_a_round_in_alternating_order():
    """--paired_decode: after one warm-up call of each, every round times one sample of each side (`calls` calls,
    one wait), ours first in even rounds and the peer first in odd ones; the times are per call."""
    mod = _script("bench_attention")
    clock = _FakeClock()
    waits = []
    pairs = mod.paired_times(clock.fn("ours", 0.003), clock.fn("peer", 0.002), rounds=3, calls=2,
                             wait_ours=waits.append, wait_peer=waits.append, clock=clock)
    assert clock.log == ["ours", "peer"] + ["ours"] * 2 + ["peer"] * 2 + ["peer"] * 2 + ["ours"] * 2 \
        + ["ours"] * 2 + ["peer"] * 2
    assert waits == ["ours", "peer", "ours", "peer", "peer", "ours", "ours", "peer"]  # one wait a sample
    assert pairs == [pytest.approx((0.003, 0.002))] * 3


def test_paired_summary_gives_the_median_ratio_its_quartiles_and_the_rounds_won():
    mod = _script("bench_attention")
    # ratios 1.1, 0.9, 1.0, 1.2, 0.95 (ours / peer): sorted 0.9 0.95 1.0 1.1 1.2
    pairs = [(1.1e-3, 1e-3), (0.9e-3, 1e-3), (2e-3, 2e-3), (1.2e-3, 1e-3), (0.95e-3, 1e-3)]
    got = mod.paired_summary(pairs)
    assert got["rounds"] == 5 and got["ours_faster"] == 2
    assert got["ours_ms"] == pytest.approx(1.1) and got["peer_ms"] == pytest.approx(1.0)
    assert got["ratio"] == pytest.approx(1.0) and got["ratio_q1"] == pytest.approx(0.95)
    assert got["ratio_q3"] == pytest.approx(1.1)
    assert (got["ratio_min"], got["ratio_max"]) == (pytest.approx(0.9), pytest.approx(1.2))


@pytest.mark.slow  # ~8 s on 2 cores: a benchmark script's smoke run (its helpers' tests stay in the default suite)
def test_bench_attention_decode_alone_paired_with_a_peer(capsys, monkeypatch):
    """--chunks "" times decode alone (no prefill table); --paired_decode R times each decode row in turns with
    PyTorch SDPA's (which a CPU has not): a stand-in peer on the CPU runs the pairing, its table and, with --profile,
    the peer's kernels; a row without a peer, or whose peer fails, says why in the table, and the run goes on."""
    mod = _script("bench_attention")
    argv = ["--small", "--impl", "reference", "--chunks", "", "--decode_batches", "1,2", "--paired_decode", "3",
            "--no_baselines"]  # no baselines: the stand-in peer is the pairing's alone
    monkeypatch.setattr(mod, "torch_wait", jax.block_until_ready)
    monkeypatch.setattr(mod, "torch_release", lambda: None)
    monkeypatch.setattr(mod, "torch_sdpa", lambda args, chunk, context, batch=1: (None, "no peer here"))
    res = mod.main(argv)
    out = capsys.readouterr().out
    assert res["prefill"] == [] and "ms/chunk" not in out
    assert [r["paired"] for r in res["decode"]] == [{"why": "no peer here"}] * 2
    assert out.rstrip().splitlines()[-1].split() == ["256", "2", "not", "timed:", "no", "peer", "here"]

    peer_calls = []

    def stand_in(args, chunk, context, batch=1):
        assert (chunk, context) == (1, 256)
        if batch == 2:  # the second row's peer fails while it is timed
            return (lambda: 1 / 0), "failing stand-in"
        return (lambda: peer_calls.append(1) or jax.numpy.ones(())), "stand-in"

    monkeypatch.setattr(mod, "torch_sdpa", stand_in)
    res = mod.main(argv + ["--calls", "2", "--profile"])
    out = capsys.readouterr().out
    paired = res["decode"][0]["paired"]
    assert paired["rounds"] == 3 and paired["variant"] == "stand-in" and paired["ratio"] > 0
    assert 0 <= paired["ours_faster"] <= 3 and "torch_profile" not in paired  # printed, not kept
    assert len(peer_calls) == 1 + 3 * 2 + 10  # the warm-up, 3 samples of 2 calls, 10 profiled calls
    assert "torch SDPA's kernels (stand-in):" in out
    assert res["decode"][1]["paired"] == {"why": "ZeroDivisionError: division by zero"} and not res["errors"]
    lines = out.rstrip().splitlines()
    assert lines[-2].split()[:2] == ["256", "1"] and lines[-2].split()[-3:] == ["of", "3", "stand-in"]
    assert lines[-1] == "     256    2  not timed: ZeroDivisionError: division by zero"  # the paired table is last
    with pytest.raises(SystemExit):
        mod.parse_args(["--small", "--paired_decode", "-1"])
    assert "--paired_decode: rounds must be >= 0" in capsys.readouterr().err


def test_short_error_is_the_type_and_the_first_line_cut():
    """A failure as a table cell; an exception without a message gives its type alone (it was an IndexError)."""
    short_error = _script("bench_attention").short_error
    assert short_error(RuntimeError("\nno kernel for you\nsecond line")) == "RuntimeError: no kernel for you"
    assert short_error(ValueError("x" * 100), 10) == "ValueError: " + "x" * 10
    assert short_error(MemoryError()) == "MemoryError: "
