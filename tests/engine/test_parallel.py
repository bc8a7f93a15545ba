"""3D parallelism gives exactly what one device gives.

A workload that mixes one long request (chunked prefill over many pages; with kvp >= 3 its KV spans three KVP
ranks, one joining mid-prefill and one mid-decode) with short requests arriving at different steps runs on
each mesh shape; prompt log-probs must be within 1e-5 of the 1x1x1 run and greedy tokens identical.
"""
import itertools
import logging
import re

import jax
import numpy as np
import pytest

from mnemojax import LLM, SamplingParams, StructuredOutputsParams
from models.params import stack_layers
from models.params import mesh_layout
from tests.hf_utils import make_hf_checkpoint

LONG_PROMPT, LONG_NEW = 66, 10
# Requests by the step they arrive at: (name, prompt length, new tokens).
ARRIVALS = {0: [("long", LONG_PROMPT, LONG_NEW)], 2: [("a", 9, 6)], 5: [("b", 17, 5), ("c", 4, 7)],
            9: [("d", 12, 4)]}
MODEL = dict(num_layers=4, num_heads=8, num_kv_heads=2, hidden_size=64, intermediate_size=96)
REQUIRED = [(1, 1, 2), (1, 2, 1), (2, 1, 1), (2, 2, 2), (4, 2, 1), (1, 2, 4), (2, 1, 4), (8, 1, 1)]


def _allowed_shapes():
    shapes = []
    for kvp, spp, tp in itertools.product(range(1, 9), range(1, 5), (1, 2, 4, 8)):
        if kvp * spp * tp <= 8 and (kvp, spp, tp) != (1, 1, 1):
            shapes.append((kvp, spp, tp))
    return shapes


def _max_tokens_per_rank(kvp):
    # kvp >= 3: ranks hold [0, 36) [36, 72) [72, ...): the second joins mid-prefill (prompt 66), the third
    # mid-decode (token 72 of 76). kvp == 2: [0, 40) [40, 80): the second joins mid-prefill.
    return None if kvp == 1 else (36 if kvp >= 3 else 40)


def run_workload(ckpt, kvp=1, spp=1, tp=1, arrivals=ARRIVALS, on_engine=None, sampling=None, **kw):
    """Drives the engine step by step with `arrivals` (by step; one request named "long"); returns outputs by name
    and span facts. `on_engine(engine)` is called once the engine is built; `sampling`: more `SamplingParams`
    fields by request name."""
    kw.setdefault("max_tokens_per_kvp_rank", _max_tokens_per_rank(kvp))
    kw.setdefault("chunk_size", 16)
    llm = LLM(model=ckpt, page_size=4, max_num_batched_tokens=32, max_model_len=96, kvp=kvp, spp=spp, tp=tp, **kw)
    engine = llm.engine
    if on_engine is not None:
        on_engine(engine)
    rng = np.random.default_rng(0)
    prompts = {name: rng.integers(0, 256, n).tolist() for reqs in arrivals.values() for name, n, _ in reqs}
    ids, onboard_at = {}, []
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for name, _, new in arrivals.get(step, []):
            ids[name] = engine.add_request(prompts[name], SamplingParams(**{
                **dict(max_tokens=new, temperature=0, prompt_logprobs=0, ignore_eos=True),
                **(sampling or {}).get(name, {})}), request_id=name)
        before = len(engine.requests["long"].kv_ranks)
        engine.step()
        long = engine.requests["long"]
        if before and len(long.kv_ranks) > before:  # a rank joined (not the first placement)
            onboard_at.append(long.num_computed)
        step += 1
        assert step < 500
    outs = {name: engine.pop_finished(rid) for name, rid in ids.items()}
    assert engine.kv.num_used == 0
    return outs, onboard_at


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("par") / "m", weight_scale=8.0, seed=4, **MODEL)


@pytest.fixture(scope="module")
def reference(ckpt):
    outs, _ = run_workload(ckpt)
    return outs


def _check_same(outs, ref):
    assert outs.keys() == ref.keys()
    for name, r in ref.items():
        o = outs[name]
        lp = [d[t] for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
        ref_lp = [d[t] for d, t in zip(r.prompt_logprobs[1:], r.prompt_token_ids[1:])]
        np.testing.assert_allclose(lp, ref_lp, atol=1e-5, rtol=0, err_msg=name)
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, name


def _check_shape(ckpt, reference, shape):
    kvp, spp, tp = shape
    outs, onboard_at = run_workload(ckpt, kvp, spp, tp)
    _check_same(outs, reference)
    if kvp >= 3:  # spans three ranks: one joins mid-prefill, one mid-decode
        assert len(onboard_at) == 2
        assert onboard_at[0] < LONG_PROMPT < onboard_at[1]
    elif kvp == 2:
        assert len(onboard_at) == 1 and onboard_at[0] < LONG_PROMPT


# Three shapes that combine two or three axes in the default suite; one axis alone, (2, 1, 4) (~19 s, forty-seventh
# session) and every other shape with the slow tests: each of tp, spp and kvp is in at least two of the three (the
# four single-axis shapes moved: ~50 worker-seconds of the default suite cold on 2 cores, forty-second session).
@pytest.mark.parametrize("shape", [pytest.param(s, marks=[] if sum(n > 1 for n in s) > 1 and s != (2, 1, 4)
                                                else [pytest.mark.slow]) for s in REQUIRED], ids=str)
def test_mesh_shape_matches_one_device(ckpt, reference, shape):
    _check_shape(ckpt, reference, shape)


# Penalties on the workload's requests (by name; "b" has none): their counts live on the device per sequence slot
# of the request's first KVP rank, where its logits row is ("long" spans three ranks with kvp >= 3).
PENALIZED = {"long": dict(repetition_penalty=1.3, frequency_penalty=0.5), "a": dict(presence_penalty=0.7),
             "c": dict(repetition_penalty=0.8, presence_penalty=-0.4), "d": dict(frequency_penalty=1.2)}


@pytest.fixture(scope="module")
def penalized_reference(ckpt, reference):
    """(Sampling by request name, its outputs on one device): PENALIZED, and bad words for "long" (three tokens) and
    "c" (one and two), taken from the penalized tokens so that each ban fires (with async scheduling, a ban whose
    prefix ends in the token the step before sampled: decided on the device, or on the host by the time a pipeline's
    micro-batch leaves it)."""
    free, _ = run_workload(ckpt, sampling=PENALIZED)
    changed = [name for name in PENALIZED if free[name].outputs[0].token_ids != reference[name].outputs[0].token_ids]
    assert len(changed) >= 2, changed  # the penalties change what is generated, so the shapes below can differ
    assert free["b"].outputs[0].token_ids == reference["b"].outputs[0].token_ids  # a request without them: its own
    long, c = (free[name].outputs[0].token_ids for name in ("long", "c"))
    sampling = {**PENALIZED, "long": {**PENALIZED["long"], "bad_words_token_ids": [long[5:8]]},
                "c": {**PENALIZED["c"], "bad_words_token_ids": [c[1:3]] + [[t] for t in c[4:] if t not in c[:3]][:1]}}
    outs, _ = run_workload(ckpt, sampling=sampling)
    for name in ("long", "c"):
        got, was = outs[name].outputs[0].token_ids, free[name].outputs[0].token_ids
        assert got != was, name
    assert outs["long"].outputs[0].token_ids[:7] == long[:7]
    assert outs["c"].outputs[0].token_ids[:2] == c[:2]  # the single token is not among the first three
    return sampling, outs


# (the 4x2x1 mesh, a KVP span of three ranks and two stages, in the default suite; the others with the slow tests,
# ~20 s each on 2 cores)
@pytest.mark.parametrize("shape, async_scheduling", [pytest.param((2, 2, 2), True, marks=pytest.mark.slow),
                                                      ((4, 2, 1), True),
                                                      pytest.param((4, 1, 2), False, marks=pytest.mark.slow),
                                                      pytest.param((2, 1, 1), True, marks=pytest.mark.slow)],
                         ids=str)
def test_penalties_on_a_mesh_match_one_device(ckpt, penalized_reference, shape, async_scheduling):
    """Presence, frequency and repetition penalties and bad words give on each mesh shape (KVP spans of three ranks,
    pipeline stages, tensor parallelism; with and without async scheduling) the tokens they give on one device."""
    sampling, want = penalized_reference
    outs, _ = run_workload(ckpt, *shape, sampling=sampling, async_scheduling=async_scheduling)
    _check_same(outs, want)


# Structured outputs' regex on the workload's requests (by name): "long" spans three KVP ranks with kvp >= 3, "c"
# joins mid-way; both stop at EOS once their text matches (ignore_eos off), the others run as before.
REGEXES = {"long": r"[a-f0-9]{2,4}( [a-f0-9]{2,4})*", "c": r"(yes|no)-[0-9]{1,2}"}


@pytest.fixture(scope="module")
def regex_reference(ckpt, reference):
    sampling = {name: dict(ignore_eos=False, structured_outputs=StructuredOutputsParams(regex=p))
                for name, p in REGEXES.items()}
    outs, _ = run_workload(ckpt, sampling=sampling)
    for name, pattern in REGEXES.items():
        c = outs[name].outputs[0]
        assert c.token_ids != reference[name].outputs[0].token_ids, name
        assert re.fullmatch(pattern, c.text) if c.finish_reason == "stop" else c.finish_reason == "length", c
    assert outs["c"].outputs[0].finish_reason == "stop"
    for name in ("a", "b", "d"):
        assert outs[name].outputs[0].token_ids == reference[name].outputs[0].token_ids
    return sampling, outs


# (~25 s on 2 cores: with the slow tests)
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 2, 1), (2, 1, 4)], ids=str)
def test_regex_on_a_mesh_matches_one_device(ckpt, regex_reference, shape):
    """A regex row's mask (a step of its own, with the masks) gives on each mesh shape (a KVP span of three ranks and
    two pipeline stages, whose micro-batches take their masks in; tensor parallelism over the vocabulary's logits)
    the tokens it gives on one device, and leaves the other requests' as they were."""
    sampling, want = regex_reference
    outs, _ = run_workload(ckpt, *shape, sampling=sampling)
    _check_same(outs, want)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [s for s in _allowed_shapes() if s not in REQUIRED], ids=str)
def test_every_other_mesh_shape_matches_one_device(ckpt, reference, shape):
    _check_shape(ckpt, reference, shape)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("spp", [1, 2, 4])
def test_pipelined_prefill_takes_k_plus_s_minus_1_steps(ckpt, spp, async_scheduling):
    """A prefill of K chunks alone on S stages completes (first token out) in K + S - 1 device steps, not K x S.
    With async scheduling the host sees the token one `step()` later (it collects a step after launching the
    next), and launches nothing more: the request ends at max_tokens=1."""
    K, chunk = 5, 16
    llm = LLM(model=ckpt, page_size=4, chunk_size=chunk, max_num_batched_tokens=chunk, max_model_len=96,
              spp=spp, async_scheduling=async_scheduling)
    e = llm.engine
    rid = e.add_request(list(range(K * chunk)), SamplingParams(max_tokens=1, temperature=0))
    steps = 0
    while not e.requests[rid].is_finished:
        e.step()
        steps += 1
    assert steps == K + spp - 1 + async_scheduling
    assert e.executor._shapes_run and not e.has_unfinished() and e.kv.num_used == 0


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 4), (1, 3, 1)], ids=str)
def test_per_device_shapes(ckpt, shape):
    """Each device holds only its stage's layers, its share of heads and MLP columns, its rank's pages."""
    kvp, spp, tp = shape
    llm = LLM(model=ckpt, page_size=4, max_model_len=96, num_pages=50, kvp=kvp, spp=spp, tp=tp)
    from models.config import LlamaConfig
    c = LlamaConfig.from_pretrained(ckpt)
    L, K = mesh_layout(c, tp=tp, spp=spp)
    Ls, D, N, Dh, F = L // spp, c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size
    expect = {"wq": (Ls, D, N // tp, Dh), "wk": (Ls, D, K // tp, Dh), "wv": (Ls, D, K // tp, Dh),
              "wo": (Ls, N // tp, Dh, D), "w_gate": (Ls, D, F // tp), "w_up": (Ls, D, F // tp),
              "w_down": (Ls, F // tp, D), "attn_norm": (Ls, D), "mlp_norm": (Ls, D)}
    ex = llm.engine.executor
    layers = stack_layers(ex.params)["layers"]
    for name, shape_ in expect.items():
        arr = layers[name]
        assert len(arr.addressable_shards) == kvp * spp * tp
        for sh in arr.addressable_shards:
            assert sh.data.shape == shape_, name
    for cache in (ex.k_cache, ex.v_cache):
        for sh in cache.addressable_shards:
            assert sh.data.shape == (Ls, 50, 4, K // tp, Dh)
    if spp == 3:  # 4 layers over 3 stages: padded to 6 with zero layers
        assert L == 6 and not np.asarray(layers["wq"])[4:].any()


@pytest.mark.slow  # ~15 s; tests/models/test_orbax.py restores on other meshes in the default suite
def test_orbax_checkpoint_restores_under_another_mesh(ckpt, reference, tmp_path):
    """Saved from a (2, 2, 2) mesh, restored into (1, 2, 4) and (4, 1, 1): the same results as the HF load."""
    import jax
    from models.orbax_io import copy_tokenizer_files, save_params
    saver = LLM(model=ckpt, page_size=4, max_model_len=96, kvp=2, spp=2, tp=2)
    from models.config import LlamaConfig
    config = LlamaConfig.from_pretrained(ckpt)
    assert saver.engine.executor.params["layers"][0]["wq"].sharding.mesh.shape["tp"] == 2
    out = tmp_path / "orbax"
    # The executor's params are in the checkpoint layout here (4 layers / 2 stages, 2 kv heads / tp 2).
    save_params(stack_layers(saver.engine.executor.params), out, config)
    copy_tokenizer_files(ckpt, out)
    del saver
    for shape in [(1, 2, 4), (4, 1, 1)]:
        outs, _ = run_workload(str(out), *shape)
        _check_same(outs, reference)
    jax.clear_caches()


# The long request's KV spans ranks 0, 1 and 2 (16 tokens each; the third joins mid-prefill); short requests
# arrive while it prefills and decodes, so other ranks run their own rows beside its shared ones.
SPREAD = {0: [("long", 40, 8)], 1: [("a", 9, 6), ("b", 13, 4)], 2: [("c", 5, 7), ("d", 20, 3)],
          4: [("e", 11, 5)], 6: [("f", 7, 6), ("g", 3, 4)]}


@pytest.mark.slow  # ~11 s on 2 cores cold; the required mesh shapes above lay KVP ranks out by default
def test_ranks_not_holding_a_long_request_reuse_its_rows_and_stay_exact(ckpt):
    """kvp = 4: a rank that does not hold the long request's KV lays its own requests in the rows of the long
    request's shared range (marked unshared there, so the KVP merge adds weight 0 from it and it keeps its own
    result). Results equal one device's: prompt log-probs within 1e-5, greedy tokens identical."""
    overlaps = []

    def watch(engine):
        ex = engine.executor
        prepare = ex.prepare

        def recording(plan, T=None):
            starts, _ = ex._row_layout(plan)
            spans = [(c.request.kv_ranks, s, s + c.num_tokens) for c, s in zip(plan.chunks, starts)]
            for ranks, lo, hi in spans:
                if len(ranks) == 1:  # a local chunk in rows of a shared chunk its rank does not hold
                    overlaps.extend((ranks[0], lo) for r2, lo2, hi2 in spans
                                    if len(r2) > 1 and ranks[0] not in r2 and lo < hi2 and lo2 < hi)
            return prepare(plan, T)

        ex.prepare = recording

    ref, _ = run_workload(ckpt, arrivals=SPREAD)
    outs, onboard_at = run_workload(ckpt, kvp=4, arrivals=SPREAD, max_tokens_per_kvp_rank=16, on_engine=watch)
    _check_same(outs, ref)
    assert len(onboard_at) == 2 and onboard_at[0] < onboard_at[1] <= 40
    assert overlaps, "no step laid a local request in the rows of a shared one"


@pytest.mark.slow  # ~9 s on 2 cores cold
def test_out_of_pages_on_a_rank_queues_or_preempts_and_stays_exact(ckpt, reference, caplog):
    """Per-rank pools of 11 usable pages (44 tokens): the long request needs 10 pages on rank 0 and 9 on rank
    1, so short requests queue or are preempted by recompute (a log line says which); results stay exact and
    every page comes back."""
    with caplog.at_level(logging.DEBUG, logger="mnemojax.scheduling"):  # the wait is a DEBUG line
        outs, _ = run_workload(ckpt, kvp=2, num_pages=12)
    _check_same(outs, reference)
    assert "preempted request" in caplog.text or "waits: not enough free KV pages" in caplog.text


@pytest.mark.parametrize("kvp,want", [(1, None), (2, "float32")])
def test_a_kvp_rank_asks_its_attention_for_float32_partials(ckpt, monkeypatch, kvp, want):
    """With kvp > 1 every layer asks the attention for float32 out (a partial the merge needs unrounded: the Mosaic
    kernels would otherwise write bf16, rounding before the merge); one rank leaves the implementation's own."""
    import models.llama as llama

    asked = []
    attention = llama.attention

    def spy(*args, **kw):
        asked.append(kw.get("out_dtype"))
        return attention(*args, **kw)

    monkeypatch.setattr(llama, "attention", spy)
    llm = LLM(model=ckpt, page_size=4, chunk_size=16, max_num_batched_tokens=32, max_model_len=96, kvp=kvp,
              max_tokens_per_kvp_rank=_max_tokens_per_rank(kvp), precompile=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(asked) >= MODEL["num_layers"]
    assert {None if a is None else str(np.dtype(a)) for a in asked} == {want}


@pytest.mark.parametrize("kvp,chunk_size", [pytest.param(3, 16, marks=pytest.mark.slow), (1, 1)])  # 3-16: ~9 s
def test_one_token_chunks_lay_out_as_the_general_path_does(ckpt, kvp, chunk_size):
    """`Executor.prepare` writes a one-token chunk (a decode, or a prompt fed a token at a time) by scalars: every
    array it hands the step equals the general path's, on every step of a workload: decodes of a request whose KV
    spans three ranks (one joining mid-decode), tokens sampled by the step still in flight (async), prompt
    log-prob rows of one-token prompt chunks."""
    from mnemojax.engine.executor import Executor

    compared = []

    def watch(engine):
        ex = engine.executor
        prepare = ex.prepare

        def both(plan, T=None):
            ex._one_token_scalars = False
            try:
                want = prepare(plan, T)
            finally:
                del ex._one_token_scalars  # back to the class's default: the scalar path
            got = prepare(plan, T)
            for g, w in zip(jax.tree.leaves((got.batch, got.rows, got.sampling, got.src)),
                            jax.tree.leaves((want.batch, want.rows, want.sampling, want.src))):
                np.testing.assert_array_equal(g, w)
            assert got.refs == want.refs
            compared.append(sum(c.num_tokens == 1 for c in plan.chunks))
            return got

        ex.prepare = both

    assert Executor._one_token_scalars
    outs, _ = run_workload(ckpt, kvp, on_engine=watch, chunk_size=chunk_size, min_chunk_size=1)
    assert sum(compared) > 20  # one-token chunks were laid out and compared
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs.values())
