"""Runtime predictor: plain-Python checks of the cost model (no jax), and one check of the shipped CPU profile
against freshly timed steps of the real executor.

The roofline checks recompute by hand, from the published Llama-3-8B shapes and the H100 preset's numbers,
what one decode (weight bytes / bandwidth) and one 2048-token prefill chunk (FLOPs / peak) must cost.
"""
import dataclasses
import json
import os
import random

import pytest

from mnemojax.scheduling.predictor import HARDWARE, PROFILE_DIR, ChunkShape, Predictor, Profile, default_profile
from models.config import preset

LLAMA8B = preset("llama3-8b")
NO_OVERHEAD = Profile(step_overhead_s=0.0, per_token_overhead_s=0.0, per_request_overhead_s=0.0,
                      per_row_overhead_s=0.0)

# Llama-3-8B by hand: D 4096, 32 query heads and 8 KV heads of 128, F 14336, 32 layers, V 128256.
L8_LAYER_PARAMS = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336  # q, k+v, o, gate+up+down
L8_LM_HEAD = 4096 * 128256


def test_hardware_presets():
    assert set(HARDWARE) >= {"a100", "h100", "h200", "cpu"}
    for hw in HARDWARE.values():
        assert hw.matmul_flops > 0 and hw.memory_bandwidth > 0 and hw.tp_bandwidth > 0
        assert hw.net_bandwidth > 0 and hw.collective_latency >= 0 and hw.memory_bytes > 0
    assert HARDWARE["h200"].memory_bandwidth > HARDWARE["h100"].memory_bandwidth > HARDWARE["a100"].memory_bandwidth
    assert HARDWARE["h100"].matmul_flops > HARDWARE["a100"].matmul_flops


# ---------------------------------------------------------------------- roofline by hand
def test_h100_decode_is_weight_bytes_over_bandwidth():
    hw = HARDWARE["h100"]
    pred = Predictor(LLAMA8B, "h100", profile=NO_OVERHEAD)
    weight_bytes = (32 * L8_LAYER_PARAMS + L8_LM_HEAD) * 2  # bf16
    by_hand = weight_bytes / (hw.memory_bandwidth * NO_OVERHEAD.linear_bw_eff)
    t = pred.decode_time(context_len=128)
    assert by_hand <= t <= 1.02 * by_hand  # KV of 128 tokens is negligible
    assert 4e-3 < t < 8e-3  # ~15 GB at ~2.5 TB/s
    # The default overheads (about 1 ms) come on top.
    assert by_hand < Predictor(LLAMA8B, "h100").decode_time(128) < 1.3 * by_hand


def test_h100_prefill_chunk_is_flops_over_peak():
    hw = HARDWARE["h100"]
    pred = Predictor(LLAMA8B, "h100", profile=NO_OVERHEAD)
    linear_flops = 2 * 2048 * 32 * L8_LAYER_PARAMS  # 28.6 TFLOP
    by_hand = linear_flops / (hw.matmul_flops * NO_OVERHEAD.linear_flops_eff)
    t = pred.step_time([ChunkShape(2048, 2048)])
    # Causal attention over 2048 keys adds ~4 x 32 x 128 x 2048^2 / 2 x 32 layers = 1.1 TFLOP at a lower
    # efficiency, the LM head 8 padded rows: a few percent.
    attention = 4 * 32 * 128 * (2048 * 2049 // 2) * 32 / (hw.matmul_flops * NO_OVERHEAD.attn_flops_eff)
    assert by_hand + attention <= t <= 1.02 * (by_hand + attention) + 1e-3
    assert 0.04 < t < 0.06
    b = pred.breakdown([ChunkShape(2048, 2048)])
    assert b["linear"] == pytest.approx(by_hand)


def test_long_context_decode_is_kv_bytes_over_bandwidth():
    hw = HARDWARE["h100"]
    pred = Predictor(LLAMA8B, "h100", profile=NO_OVERHEAD)
    ctx = 1_000_000
    kv_bytes = ctx * 32 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16 = 131 GB
    b = pred.breakdown([ChunkShape(1, ctx)])
    assert b["attention"] == pytest.approx(kv_bytes / (hw.memory_bandwidth * NO_OVERHEAD.attn_bw_eff))


# ---------------------------------------------------------------------- monotonicity
def _predictors():
    cpu = Profile(attention="reference", block_tokens=128, attn_block_overhead_s=1e-5)
    yield Predictor(preset("tiny"), "cpu", dtype_bytes=4, profile=cpu)
    yield Predictor(preset("tiny"), "cpu", dtype_bytes=4, profile="cpu")
    yield Predictor(LLAMA8B, "h100")
    yield Predictor(LLAMA8B, "h200", tp=8, spp=4, kvp=2)
    yield Predictor(LLAMA8B, "h100", tp=8, kvp=4, max_tokens_per_kvp_rank=16384)  # ranks filled in order
    yield Predictor(preset("llama3-70b"), "a100", tp=8, spp=2, pipeline_tokens=2048)
    yield Predictor(LLAMA8B, "h100", profile=dataclasses.replace(NO_OVERHEAD, pad_tokens_min=0, pad_rows_min=0))


@pytest.mark.parametrize("pred", list(_predictors()), ids=lambda p: f"{p.hardware.name}-{p.profile.attention}")
def test_more_work_is_never_faster(pred):
    rng = random.Random(0)
    for _ in range(300):
        chunks = [ChunkShape(q, q + rng.randrange(0, 100_000), rng.choice((1, 1, 2, 4)))
                  for q in (rng.choice((1, 1, 1, 7, 64, 300, 2048)) for _ in range(rng.randrange(1, 8)))]
        t = pred.step_time(chunks)
        assert t > 0
        i = rng.randrange(len(chunks))
        c = chunks[i]
        more_tokens = chunks[:i] + [ChunkShape(c.query_tokens + rng.randrange(1, 500),
                                               c.context_len + 500, c.num_ranks)] + chunks[i + 1:]
        longer = chunks[:i] + [ChunkShape(c.query_tokens, c.context_len + rng.randrange(1, 50_000),
                                          c.num_ranks)] + chunks[i + 1:]
        another = chunks + [ChunkShape(1, rng.randrange(1, 100_000))]
        for bigger in (more_tokens, longer, another):
            assert pred.step_time(bigger) >= t, (chunks, bigger)
    for ctx in (1, 10, 1000, 10**6):
        assert pred.decode_time(ctx + 1) >= pred.decode_time(ctx)
        assert pred.decode_time(ctx, batch=4) >= pred.decode_time(ctx, batch=3)
    assert pred.prefill_time(10_000, 512) >= pred.prefill_time(9_000, 512)
    assert pred.prefill_time(10_000, 512, context_start=1000) <= pred.prefill_time(10_000, 512)


# ---------------------------------------------------------------------- parallelism
def test_kvp_halves_attention_of_a_long_decode():
    ctx = 2_000_000
    one = Predictor(LLAMA8B, "h100", tp=8)
    two = Predictor(LLAMA8B, "h100", tp=8, kvp=2)
    a1 = one.breakdown([ChunkShape(1, ctx)])
    a2 = two.breakdown([ChunkShape(1, ctx, num_ranks=2)])
    assert a2["attention"] == pytest.approx(a1["attention"] / 2, rel=1e-6)
    assert a1["kvp_merge"] == 0 < a2["kvp_merge"] < 1e-3  # query-sized: a few latencies
    assert two.decode_time(ctx, num_ranks=2) < one.decode_time(ctx)
    assert a2["linear"] == a1["linear"]  # replicated on each rank


def test_kvp_costs_the_busiest_rank_as_the_page_manager_fills_them():
    # The page manager fills a request's first rank to max_tokens_per_kvp_rank before the next joins, so a
    # decode just past the limit costs its first rank's m keys, not half of the context.
    m = 131072
    one = Predictor(LLAMA8B, "h100", tp=8)
    two = Predictor(LLAMA8B, "h100", tp=8, kvp=2, max_tokens_per_kvp_rank=m)
    attention = lambda pred, *shape: pred.breakdown([ChunkShape(*shape)])["attention"]
    assert attention(two, 1, m + 16, 2) == pytest.approx(attention(one, 1, m), rel=1e-12)
    assert two.decode_time(m + 16, num_ranks=2) > one.decode_time(m)
    assert attention(two, 1, 2 * m, 2) == pytest.approx(attention(one, 1, m), rel=1e-12)  # both ranks full
    # A prefill chunk straddling the limit, queries [m - 1024, m + 1024): its first rank sees all m keys from
    # the last 1024 queries and a causal triangle's worth from the first; the second rank only 1024 keys.
    hw, p = HARDWARE["h100"], two.profile
    pairs = 1024 * m + sum(range(m - 1024 + 1, m + 1))
    by_hand = 32 * max(4 * pairs * 4 * 128 / (hw.matmul_flops * p.attn_flops_eff),  # 32 heads / tp 8
                       m * 2 * 1 * 128 * 2 / (hw.memory_bandwidth * p.attn_bw_eff))  # K, V x 1 kv head x bf16
    assert attention(two, 2048, m + 1024, 2) == pytest.approx(by_hand, rel=1e-12)
    assert attention(one, 2048, m) < by_hand < attention(one, 2048, m + 1024)


def test_spp_cuts_stage_time_and_tp_cuts_step_time():
    chunk = [ChunkShape(2048, 100_000)]
    t1 = Predictor(LLAMA8B, "h100").stage_time(chunk)
    t4 = Predictor(LLAMA8B, "h100", spp=4).stage_time(chunk)
    assert t4 < t1 / 3  # 8 of 32 layers per stage; the LM head and the activation send on top
    assert Predictor(LLAMA8B, "h100", spp=4).breakdown(chunk)["spp_send"] > 0
    tp8 = Predictor(LLAMA8B, "h100", tp=8)
    assert tp8.step_time(chunk) < t1 / 4
    assert tp8.breakdown(chunk)["tp_allreduce"] > 0
    # Padding layers: 80 layers over 3 stages run 27 per stage.
    assert Predictor(preset("llama3-70b"), "h100", spp=3).layers_per_stage == 27


def test_prefill_time_is_k_plus_spp_minus_one_stage_times():
    pred = Predictor(LLAMA8B, "h100", tp=8, spp=4)
    stages = [pred.stage_time([ChunkShape(2048, end)]) for end in (2048, 4096, 6144, 8192)]
    assert pred.prefill_time(8192, 2048) == pytest.approx(sum(stages) + 3 * stages[-1])
    # A ragged last chunk, and a start in the middle: 2 + 3 steps; while both chunks are in flight (steps 2-4)
    # the slower one sets the pace, then the last step holds the second chunk alone.
    a, b = (pred.stage_time([ChunkShape(n, end)]) for n, end in ((2048, 3048), (952, 4000)))
    assert a > b  # fewer tokens, a little more context
    assert pred.prefill_time(4000, 2048, context_start=1000) == pytest.approx(a + 3 * max(a, b) + b)
    flat = Predictor(LLAMA8B, "h100", tp=8)
    assert flat.prefill_time(8192, 2048) == pytest.approx(
        sum(flat.stage_time([ChunkShape(2048, end)]) for end in (2048, 4096, 6144, 8192)))
    assert pred.prefill_time(100, 64, context_start=100) == 0.0
    # Medha's SPP: prefill of a long prompt falls almost linearly with the stages.
    assert pred.prefill_time(1_000_000, 4096) < 0.35 * flat.prefill_time(1_000_000, 4096)


def test_prefill_spreads_over_kvp_ranks_like_the_page_manager():
    pred = Predictor(LLAMA8B, "h100", kvp=4, max_tokens_per_kvp_rank=100_000)
    assert [pred._ranks(n) for n in (1, 100_000, 100_001, 10**7)] == [1, 1, 2, 4]
    assert Predictor(LLAMA8B, "h100", kvp=4)._ranks(10**7) == 1  # no limit: one rank


def test_pipeline_pads_every_micro_batch_to_the_register():
    pred = Predictor(LLAMA8B, "h100", spp=2, pipeline_tokens=1000)
    assert pred.padded_tokens([ChunkShape(1, 10)]) == 1024
    assert Predictor(LLAMA8B, "h100", pipeline_tokens=1000).padded_tokens([ChunkShape(1, 10)]) == 16
    assert Predictor(LLAMA8B, "h100").padded_tokens([ChunkShape(17, 20)]) == 32


# ---------------------------------------------------------------------- profiles
def test_attention_cost_models_by_the_engines_kernel_names():
    """The predictor reads the engine's names (`models.kernels`): pallas is the ragged kernel's cost (the
    default), reference the blockwise reference's, auto whichever runs on the hardware predicted."""
    plan = [ChunkShape(100, 5000), ChunkShape(1, 300)]

    def attention_s(hardware, name):
        return Predictor(LLAMA8B, hardware, profile=dataclasses.replace(NO_OVERHEAD, attention=name)).breakdown(
            plan)["attention"]

    assert Profile().attention == "pallas"
    assert attention_s("h100", "reference") > attention_s("h100", "pallas")  # padded rows x the longest's blocks
    for hardware, runs in (("h100", "pallas"), ("a100", "pallas"), ("h200", "pallas"), ("cpu", "reference")):
        assert HARDWARE[hardware].nvidia_gpu == (runs == "pallas")
        assert attention_s(hardware, "auto") == attention_s(hardware, runs)
        assert Predictor(LLAMA8B, hardware, profile=Profile(attention="auto")).attention == runs
    with pytest.raises(ValueError, match="unknown attention implementation 'paged'; valid: auto, reference, pallas"):
        Profile(attention="paged")
    with pytest.raises(ValueError, match="'pallas_interpret' has no cost model"):
        Profile(attention="pallas_interpret")
    with pytest.raises(ValueError, match="'mosaic_interpret' has no cost model"):
        Profile(attention="mosaic_interpret")
    assert attention_s("h100", "mosaic") == attention_s("h100", "pallas")  # same ideal kernel until measured


@pytest.mark.parametrize("field, value", [("step_overhead_s", float("nan")), ("step_overhead_s", float("inf")),
                                          ("per_token_overhead_s", float("nan")), ("linear_flops_eff", float("inf")),
                                          ("attn_bw_eff", float("nan"))])
def test_profile_rejects_nan_and_infinite_values(field, value):
    """json.load reads NaN and Infinity: such a profile made every step time NaN."""
    with pytest.raises(ValueError, match=field):
        Profile(**{field: value})


def test_profile_round_trip(tmp_path):
    prof = Profile(linear_flops_eff=0.3, attn_block_overhead_s=2e-5, attention="reference", block_tokens=64)
    pred = Predictor(preset("tiny"), "cpu", dtype_bytes=4, profile=prof)
    path = str(tmp_path / "sub" / "p.json")
    info = pred.save_profile(path, model="tiny", note="x")
    assert info["hardware"] == "cpu" and info["dtype"] == "float32" and info["note"] == "x"
    loaded = Predictor.load_profile(path)
    assert loaded == json.loads(open(path).read())
    again = Predictor(preset("tiny"), "cpu", profile=path)
    assert again.profile == prof and again.dtype_bytes == 4  # dtype from the file
    plan = [ChunkShape(100, 1000), ChunkShape(1, 50)]
    assert again.step_time(plan) == pred.step_time(plan)
    assert Predictor(preset("tiny"), "cpu", dtype_bytes=4, profile=prof.to_dict()).profile == prof
    with pytest.raises(ValueError, match="unknown profile factor"):
        Profile.from_dict({"linear_flop_eff": 0.5})
    with pytest.raises(ValueError, match="attention"):
        Profile(attention="flash")
    with pytest.raises(ValueError, match="fitted on hardware 'cpu'"):
        Predictor(preset("tiny"), "h100", profile=path)


def test_shipped_cpu_profile():
    assert default_profile("cpu") == os.path.join(PROFILE_DIR, "cpu.json")
    assert default_profile("a100") is None  # no shipped profile: the predictor's defaults
    assert Predictor(preset("tiny"), "cpu", profile="cpu", block_tokens=64).profile.block_tokens == 64
    info = Predictor.load_profile("cpu")
    assert info == Predictor.load_profile(os.path.join(PROFILE_DIR, "cpu.json"))
    assert info["hardware"] == "cpu" and info["model"] == "tiny" and info["dtype"] == "float32"
    assert info["factors"]["attention"] == "reference"
    for key in ("date", "command", "engine", "timing", "errors", "samples"):
        assert key in info
    assert info["errors"]["held_out"]["max"] < 0.25
