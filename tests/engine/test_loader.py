"""Loading separated from running: `loader.load` resolves the parts once, engines run on them; the one KV page
size formula; multi-host's channel given to the constructor."""
import dataclasses

import pytest

from mnemojax import SamplingParams
from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
from mnemojax.engine.loader import engine_attention, load
from models.config import preset

CFG = EngineConfig(model="tiny", max_model_len=64, page_size=4, chunk_size=16, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def _run(engine, prompt):
    rid = engine.add_request(prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_finished(rid).outputs[0].token_ids


def test_engines_share_loaded_parts_and_agree():
    loaded = load(CFG)
    assert (loaded.max_model_len, loaded.num_pages) == (64, 1 + 4 * 16)  # default: 4 full-length requests
    assert CFG.attention == "auto" and loaded.spec.attention == "reference"  # auto, resolved: no GPU in the tests
    a, b = LLMEngine(CFG, loaded), LLMEngine(CFG, loaded)
    assert a.executor.params is b.executor.params is loaded.params  # nothing loaded twice
    prompt = list(range(40, 60))
    assert _run(a, prompt) == _run(b, prompt) == _run(LLMEngine(CFG), prompt)


def test_the_engine_resolves_auto_against_its_model(monkeypatch):
    """`engine_attention`: what the loader's ModelSpec and the predictor take. On a (pretended) Hopper GPU, auto is
    the Mosaic kernels for a bf16 Llama-3-8B with pages of 16, the Pallas kernels for float32 or for the tiny
    model (head dim 16); a named implementation is itself; on a CPU, the reference."""
    from models import attention as attn_mod

    monkeypatch.setattr(attn_mod, "on_nvidia_gpu", lambda: False)  # a CPU, whatever runs the tests
    monkeypatch.setattr(attn_mod, "on_hopper_gpu", lambda: False)
    assert engine_attention(CFG, preset("tiny")) == "reference"
    monkeypatch.setattr(attn_mod, "on_nvidia_gpu", lambda: True)
    monkeypatch.setattr(attn_mod, "on_hopper_gpu", lambda: True)
    bf16 = dataclasses.replace(CFG, dtype="bfloat16", page_size=16)
    assert engine_attention(bf16, preset("llama3-8b")) == "mosaic"
    assert engine_attention(dataclasses.replace(bf16, dtype="float32"), preset("llama3-8b")) == "pallas"
    assert engine_attention(bf16, preset("tiny")) == "pallas"
    assert engine_attention(dataclasses.replace(bf16, attention="pallas"), preset("llama3-8b")) == "pallas"


@pytest.mark.parametrize("tp,spp,want_layers,want_heads", [(1, 1, 4, 2), (2, 1, 4, 1), (1, 3, 2, 2), (4, 1, 4, 1)])
def test_kv_page_bytes_by_hand(tp, spp, want_layers, want_heads):
    """tiny: 4 layers, 2 KV heads of 16. Per device: its stage's layers (4 padded to a multiple of spp, then
    split) and its tp share of the KV heads (repeated when tp exceeds them)."""
    c = preset("tiny")
    assert c.kv_page_bytes(page_size=16, tp=tp, spp=spp, dtype_bytes=2) == 2 * want_layers * 16 * want_heads * 16 * 2


def test_multi_host_channel_is_a_constructor_argument():
    class Channel:
        def __init__(self):
            self.steps, self.tables = [], []

        def step(self, T, R, packed, fetch, kind, masked=False):
            self.steps.append((T, R, fetch))

        def table(self, updates):
            self.tables.append(updates.shape)

    channel = Channel()
    engine = LLMEngine(dataclasses.replace(CFG, max_num_seqs=4), channel=channel)
    assert engine.executor.channel is channel
    _run(engine, [1, 2, 3])
    assert len(channel.steps) == 5  # one broadcast per step: a prefill that samples, then 4 decodes
    assert channel.tables  # and the page-table updates before the steps that change the table


def test_dtype_auto_is_the_checkpoints_stored_dtype(tmp_path):
    """dtype auto (the default, vLLM's and transformers 5's): a bf16 checkpoint runs in bfloat16, a float32 one in
    float32, a float16 one in float32 (which holds it exactly: mnemojax computes in float32 or bfloat16), as does
    an Orbax conversion of the bf16 one in bfloat16 (its marker's dtype) and a preset (random weights)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mnemojax.engine.loader import model_dtype
    from models.orbax_io import save_params
    from models.checkpoint import load_hf_params
    from models.config import LlamaConfig
    from tests.hf_utils import make_hf_checkpoint

    small = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, tokenizer=False)
    paths = {d: make_hf_checkpoint(tmp_path / d, dtype=d, **small) for d in ("float32", "bfloat16", "float16")}
    assert [model_dtype(paths[d]) for d in ("float32", "bfloat16", "float16")] == ["float32", "bfloat16", "float32"]
    assert model_dtype("tiny") == "float32"
    config = LlamaConfig.from_pretrained(paths["bfloat16"])
    orbax = save_params(load_hf_params(paths["bfloat16"], config, jnp.bfloat16, progress=False),
                        tmp_path / "orbax", config)
    assert model_dtype(orbax) == "bfloat16"
    engine = LLMEngine(EngineConfig(model=paths["bfloat16"], max_model_len=32, page_size=4, precompile=False))
    assert engine.config.dtype == "bfloat16"
    assert {np.dtype(a.dtype) for a in jax.tree.leaves(engine.executor.params)} == {np.dtype(jnp.bfloat16)}
    assert EngineConfig().dtype == "auto"
