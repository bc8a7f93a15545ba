"""Echo, prompt log-probs and the tokenizer endpoints on the tiny model, against the offline `LLM`'s
`prompt_logprobs` (computed by the engine's own path for the library, independently of the server's formatting)."""
import json

import httpx
import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.async_llm import AsyncLLM
from mnemojax.serving.app import build_app
from models.tokenizer import ByteTokenizer
from tests.server_utils import ThreadServer

KW = dict(max_model_len=64, page_size=4, num_pages=64, chunk_size=16, max_num_batched_tokens=32, max_num_seqs=8)
KEY = "sekrit"
PROMPT = "The cat sat on the mat."
TOK = ByteTokenizer()


def token_str(t: int) -> str:
    """A token as OpenAI's logprobs write it: its text, or `bytes:\\xNN` when it is not whole UTF-8."""
    s = TOK.decode([t], skip_special_tokens=False)
    return s if "\ufffd" not in s else f"bytes:\\x{t:02x}"


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny", **KW)


@pytest.fixture(scope="module")
def url():
    llm = AsyncLLM("tiny", **KW)
    s = ThreadServer(build_app(llm, served_model_name="tiny", api_key=KEY))
    yield s.url
    s.stop()
    llm.shutdown()


def post(url, path, body, key=KEY):
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def ref(offline, prompt, k, max_tokens=1):
    return offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=k,
                                                     prompt_logprobs=k))[0]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_align_with_offline_prompt_logprobs(url, offline, max_tokens):
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
                                       "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want = ref(offline, PROMPT, 2, max(max_tokens, 1))
    ids, plps = want.prompt_token_ids, want.prompt_logprobs
    gen = want.outputs[0] if max_tokens else None
    assert ids == TOK.encode(PROMPT)  # BOS first
    lp = choice["logprobs"]
    n = len(ids) + (max_tokens and len(gen.token_ids))
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:len(ids)] == ["<|begin_of_text|>"] + list(PROMPT)
    np.testing.assert_array_equal(lp["token_logprobs"][1:len(ids)], [d[t] for t, d in zip(ids[1:], plps[1:])])
    for t, d, top in zip(ids[1:], plps[1:], lp["top_logprobs"][1:len(ids)]):
        best = sorted(d.items(), key=lambda kv: -kv[1])[:2]  # the two most likely, and the prompt's own token
        assert top == {token_str(k): v for k, v in best + [(t, d[t])]}
        assert top[token_str(t)] == d[t]
    text = choice["text"]
    assert text == PROMPT + ("" if not max_tokens else gen.text)
    # Offsets: BOS is not in the text (zero width); each other prompt token's text is at its offset; the
    # completion starts after the prompt.
    assert lp["text_offset"][:2] == [0, 0]
    for tok, off in zip(lp["tokens"][1:len(ids)], lp["text_offset"][1:len(ids)]):
        assert text[off:off + len(tok)] == tok
    assert lp["text_offset"][len(ids):len(ids) + 1] == ([len(PROMPT)] if max_tokens else [])
    if max_tokens:
        np.testing.assert_array_equal(lp["token_logprobs"][len(ids):], [d[t] for t, d in zip(gen.token_ids,
                                                                                              gen.logprobs)])
        assert choice["finish_reason"] == gen.finish_reason
    else:
        assert choice["finish_reason"] == "length"
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == (max_tokens and len(gen.token_ids))


def test_echo_token_ids_prompt_and_n(url, offline):
    """lm-eval's request: token ids, max_tokens 1, logprobs 1, echo; with n = 2 each choice echoes the prompt."""
    ids = TOK.encode("Q: 2+2? A: 4", add_special_tokens=False)
    r = post(url, "/v1/completions", {"prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                       "echo": True, "n": 2})
    assert r.status_code == 200, r.text
    want = ref(offline, ids, 1)
    for choice in r.json()["choices"]:
        assert choice["text"].startswith("Q: 2+2? A: 4")
        lp = choice["logprobs"]["token_logprobs"]
        assert lp[0] is None
        # The two choices run batched together, the reference alone: float32 sums in another order (as in
        # test_server.py's comparisons with the offline LLM).
        np.testing.assert_allclose(lp[1:len(ids)], [d[t] for t, d in zip(ids[1:], want.prompt_logprobs[1:])],
                                   rtol=0, atol=1e-6)


def test_prompt_logprobs_vllm_shape(url, offline):
    want = ref(offline, PROMPT, 3)
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == want.outputs[0].text and choice["logprobs"] is None
    got = choice["prompt_logprobs"]
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for t, d, entry in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:], got[1:]):
        best = sorted(d.items(), key=lambda kv: -kv[1])[:3]
        assert {int(k): v["logprob"] for k, v in entry.items()} == dict(best + [(t, d[t])])
        assert [entry[str(k)]["rank"] for k, _ in best] == [1, 2, 3]
        assert entry[str(t)]["decoded_token"] == token_str(t)
        if t not in dict(best):
            assert entry[str(t)]["rank"] is None
    # The chat endpoint has them once, beside the choices (vLLM's shape).
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                            "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    chat_ids = TOK.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    want = ref(offline, chat_ids, 0)
    got = r.json()["prompt_logprobs"]
    assert got[0] is None and [e[str(t)]["logprob"] for t, e in zip(chat_ids[1:], got[1:])] == \
        [d[t] for t, d in zip(chat_ids[1:], want.prompt_logprobs[1:])]


def _streamed(url, body) -> dict[int, list[dict]]:
    """A stream's choices, chunk by chunk, by choice index."""
    chunks: dict[int, list[dict]] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    chunks.setdefault(c["index"], []).append(c)
    return chunks


@pytest.mark.parametrize("prompt, max_tokens, stop", [
    pytest.param(PROMPT, 0, None, marks=pytest.mark.slow), pytest.param(PROMPT, 6, None, marks=pytest.mark.slow),
    (PROMPT, 12, ["\x7fA"]),  # the greedy text has that stop string
    ([256, 256], 3, None),  # special tokens only: the prompt's text is empty, its log-probs are not
])
def test_streamed_echo_equals_the_whole_response(url, prompt, max_tokens, stop):
    """Echo with stream (vLLM's): each choice's first chunk leads with the prompt's text and log-probs, and a
    choice's chunks joined are the whole response's choice: text, tokens, offsets, log-probs (these to float32
    rounding: the two requests run in other batches); also when a stop string cuts the text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2, "echo": True, "n": 2,
            "stop": stop, "ignore_eos": True}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"]
    streamed = _streamed(url, body)
    assert sorted(streamed) == [0, 1]
    for choice in whole:
        mine = streamed[choice["index"]]
        ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
        assert mine[0]["text"].startswith(TOK.decode(ids)) and len(mine[0]["logprobs"]["tokens"]) >= len(ids)
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"] == ("stop" if stop else "length")
        lps = [c["logprobs"] for c in mine]
        for key in ("tokens", "text_offset"):
            assert sum((lp[key] for lp in lps), []) == choice["logprobs"][key]
        got = sum((lp["token_logprobs"] for lp in lps), [])
        assert got[0] is None and choice["logprobs"]["token_logprobs"][0] is None
        np.testing.assert_allclose(got[1:], choice["logprobs"]["token_logprobs"][1:], rtol=0, atol=1e-6)
        tops = sum((lp["top_logprobs"] for lp in lps), [])
        assert [t and list(t) for t in tops] == [t and list(t) for t in choice["logprobs"]["top_logprobs"]]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "a", "prompt_logprobs": 10_000}, "prompt_logprobs"),
    ({"prompt": "a", "prompt_logprobs": "1"}, "prompt_logprobs"),
])
def test_bad_echo_and_prompt_logprobs_are_400_naming_the_field(url, body, param):
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_endpoints(url):
    r = post(url, "/tokenize", {"prompt": "hé", "return_token_strs": True})
    assert r.json() == {"count": 4, "max_model_len": 64, "tokens": [256, 104, 195, 169],
                        "token_strs": ["<|begin_of_text|>", "h", "bytes:\\xc3", "bytes:\\xa9"]}
    r = post(url, "/tokenize", {"prompt": "hi", "add_special_tokens": False})
    assert r.json()["tokens"] == [104, 105] and r.json()["token_strs"] is None
    msgs = [{"role": "user", "content": "hi"}]
    assert post(url, "/tokenize", {"messages": msgs}).json()["tokens"] == \
        TOK.apply_chat_template(msgs, tokenize=True)
    assert post(url, "/detokenize", {"tokens": [256, 104, 195, 169]}).json() == {"prompt": "<|begin_of_text|>hé"}
    info = httpx.get(f"{url}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["eos_token"] == "<|end_of_text|>" and info["bos_token"] == "<|begin_of_text|>"
    assert info["model_max_length"] == 64 and info["vocab_size"] == TOK.vocab_size
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [TOK.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": "a"}, "tokens")]:
        r = post(url, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


@pytest.mark.parametrize("method, path", [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info")])
def test_tokenizer_endpoints_need_the_api_key(url, method, path):
    r = httpx.request(method, f"{url}{path}", json={"prompt": "a", "tokens": [1]},
                      headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
