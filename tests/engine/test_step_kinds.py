"""Steps by kind (issue 12, item 2): with attention kernels, the executor compiles a step per kind (decode only,
prefill only, mixed) and runs each step as the kind its micro-batches hold, so a decode-only step launches no
prefill kernel. Results equal the reference attention's; with the reference there is one kind."""
import pytest

from mnemojax import LLM, SamplingParams
from models.kernels import DECODE, MIXED, PREFILL, step_kind


def test_step_kind_of_query_token_counts():
    assert step_kind([1, 1, 1]) == DECODE and step_kind([2, 7]) == PREFILL and step_kind([1, 5]) == MIXED
    assert step_kind([]) == MIXED


@pytest.mark.slow  # ~20 s (the default suite's ten minutes, forty-seventh session)
def test_engine_runs_each_kind_and_matches_the_reference():
    kw = dict(model="tiny", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32)
    prompts = [list(range(5, 45)), list(range(100, 103))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = LLM(attention="pallas_interpret", **kw)
    ex = llm.engine.executor
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # 32 + 3 prompt tokens (prefill only), 8 + a decode (mixed), then decodes only
    assert {kind for _, _, kind, _ in ex._shapes_run} == {PREFILL, MIXED, DECODE}
    assert {k for _, _, k in ex.shape_buckets()} == {PREFILL, MIXED, DECODE}
    ref = LLM(attention="reference", **kw)
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    assert {k for _, _, k in ref.engine.executor.shape_buckets()} == {MIXED}


def test_tile_metadata_is_computed_once_per_step_not_per_layer():
    """The prefill tiles' metadata (an argsort of the rows by sequence) depends only on the step's metadata, so
    the compiled step computes it once for all layers (XLA shares the layers' identical computations): one sort
    in a 4-layer prefill step."""
    import re

    llm = LLM(model="tiny", attention="pallas_interpret", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, chunk_size=32)
    e = llm.engine
    assert e.model_config.num_layers == 4
    e.add_request(list(range(5, 45)), SamplingParams(max_tokens=3, temperature=0))
    e.add_request(list(range(100, 103)), SamplingParams(max_tokens=3, temperature=0))
    hlo = e.executor.lower(e.scheduler.schedule()).compile().as_text()
    assert len(re.findall(r" sort\(", hlo)) == 1  # the tiles argsort; the sampler sorts nothing
