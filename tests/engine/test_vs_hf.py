"""Against Hugging Face transformers (PyTorch, CPU, float32) on tiny random checkpoints saved here.

Prompt log-probs within 1e-4 and greedy tokens identical to HF `generate` for 32 tokens, for MHA, GQA, MQA,
llama3 RoPE scaling, tied embeddings and odd sizes. Weights are scaled up so next-token distributions are
peaked and a greedy choice is not a coin flip between two near-equal logits.
"""
import numpy as np
import pytest
import torch

from mnemojax import LLM, SamplingParams
from tests.hf_utils import load_hf_model, make_hf_checkpoint

CONFIGS = {
    "mha": dict(num_heads=4, num_kv_heads=4),
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mqa": dict(num_heads=4, num_kv_heads=1),
    "llama3_rope": dict(num_heads=4, num_kv_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "tied": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "odd_sizes": dict(vocab_size=301, hidden_size=72, intermediate_size=100, num_layers=3, num_heads=6,
                      num_kv_heads=3, head_dim=20),
}
PROMPT_LENS = (7, 29, 50)
NUM_GREEDY = 32


def _prompts(vocab_size, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in PROMPT_LENS]


# GQA and llama3 RoPE scaling in the default suite; MHA, MQA, tied embeddings and odd sizes (~10 s each on 2 cores)
# with the slow tests.
@pytest.mark.parametrize("name", [n if n in ("gqa", "llama3_rope") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CONFIGS])
def test_matches_hf(name, tmp_path):
    kw = dict(CONFIGS[name])
    path = make_hf_checkpoint(tmp_path / name, weight_scale=8.0, seed=1, **kw)
    hf = load_hf_model(path)
    hf.generation_config.eos_token_id = None  # compare 32 tokens even if EOS comes up
    prompts = _prompts(kw.get("vocab_size", 320), seed=len(name))

    llm = LLM(model=path, dtype="float32", page_size=4, chunk_size=16, max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_GREEDY, temperature=0, prompt_logprobs=0,
                                                ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = hf(ids).logits[0].double()
            ref = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), ids[0, 1:]].numpy()
            # An explicit mask: without one HF infers padding from pad_token_id, which the prompt may contain.
            hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_GREEDY,
                                    do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.prompt_logprobs[0] is None
        ours = np.array([out.prompt_logprobs[i][t] for i, t in enumerate(prompt) if i > 0])
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        assert len(hf_tokens) == NUM_GREEDY
        assert out.outputs[0].token_ids == hf_tokens
        assert out.outputs[0].finish_reason == "length"
