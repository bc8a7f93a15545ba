"""The compiled step reads each layer's weights in place: in the optimized HLO, nothing makes an array of a layer
weight's shape out of stored arrays alone (a layer loop over stacked weights copies every layer's slice each step:
the 7 device-to-device copies a layer of issue 12's GPU trace). `scripts/aot_step.py` makes the same check on the
step compiled for an H100."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

from mnemojax.bench.aot_step import weight_copies
from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
from mnemojax.scheduling.sampling_params import SamplingParams


def test_the_check_finds_the_copies_of_a_scan_over_stacked_weights():
    w = jnp.ones((4, 32, 48), jnp.float32)

    def layers(x, w):
        return lax.scan(lambda h, wl: (jnp.tanh(h @ wl @ wl.T), None), x, w)[0]

    hlo = jax.jit(layers).lower(jnp.ones((8, 32)), w).compile().as_text()
    assert weight_copies(hlo, {(32, 48)})


@pytest.mark.parametrize("spp", [1, 2])
def test_engine_step_reads_layer_weights_in_place(spp):
    engine = LLMEngine(EngineConfig(model="tiny", spp=spp, max_num_seqs=8, max_num_batched_tokens=64,
                                    chunk_size=64, max_model_len=512))
    layers = engine.executor.params["layers"]
    assert len(layers) == 4 // spp and all(a.shape[0] == spp for a in jax.tree.leaves(layers))
    shapes = {tuple(a.shape[1:]) for a in jax.tree.leaves(layers) if a.ndim >= 3}  # the matrices
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=2, temperature=0))
    hlo = engine.executor.lower(engine.scheduler.schedule()).compile().as_text()
    assert len(shapes) >= 5 and weight_copies(hlo, shapes) == []
    # Nor does the step sort anything: the sampler finds top-k / top-p by bisection (greedy rows skip even that),
    # and the log-probs' top-k is a TopK (on a CPU a partial sort of its own), run only when a row asked for it.
    assert " sort(" not in hlo
