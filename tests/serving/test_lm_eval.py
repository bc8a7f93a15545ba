"""lm-evaluation-harness itself (its `lm_eval` command, `local-completions`) against the server on the tiny model,
with task files the test writes (no downloads): a multiple-choice task and a perplexity task (log-likelihoods through
`echo`) and a generation task. Every request must succeed, and each log-likelihood lm-eval computes must equal the
sum of the offline `LLM`'s prompt log-probs of the same tokens after the same context."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.engine.async_llm import AsyncLLM
from mnemojax.serving.app import build_app
from models.tokenizer import ByteTokenizer
from tests.server_utils import ThreadServer, metrics


KW = dict(max_model_len=128, page_size=4, num_pages=64, chunk_size=32, max_num_batched_tokens=64, max_num_seqs=8)
KEY = "eval-key"
MC = [{"question": "Q: 2+2=", "choices": [" 4", " 5", " four"], "answer": 0},
      {"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
      {"question": "Capital of France:", "choices": [" Paris", " Rome", " Oslo", " Bern"], "answer": 0}]
GEN = [{"question": "Say hi:", "answer": " hi"}, {"question": "1, 2, 3,", "answer": " 4"}]
PPL = [{"text": "A rolling window of text."}, {"text": "Perplexity, exactly."}]


def write_tasks(root) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
    (root / "ppl.jsonl").write_text("".join(json.dumps(d) + "\n" for d in PPL))
    (root / "tiny_ppl.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_ppl
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "ppl.jsonl"}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
        """))
    (root / "tiny_mc.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        target_delimiter: ""
        metric_list:
          - metric: acc
        """))
    (root / "tiny_gen.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "gen.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: answer
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 8
        metric_list:
          - metric: exact_match
        """))


@pytest.mark.slow
def test_lm_eval_local_completions(tmp_path):
    llm = AsyncLLM("tiny", **KW)
    server = ThreadServer(build_app(llm, served_model_name="tiny", api_key=KEY))
    try:
        write_tasks(tmp_path)
        out = tmp_path / "out"
        env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
               "--model_args", f"model=tiny,base_url={server.url}/v1/completions,auth_token={KEY},"
                               "num_concurrent=1,max_retries=1,max_length=128",
               "--tasks", "tiny_mc,tiny_gen,tiny_ppl", "--include_path", str(tmp_path), "--output_path", str(out),
               "--log_samples"]
        start = time.monotonic()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        print(f"lm_eval ran in {time.monotonic() - start:.1f} s")
        m = metrics(server.url)
    finally:
        server.stop()
        llm.shutdown()
    # Every request succeeded: no error response, and each choice of each question and each generation finished.
    assert not [k for k in m if k.startswith("mnemojax_http_errors")], m
    assert sum(v for k, v in m.items() if k.startswith("mnemojax_request_success_total")) == \
        sum(len(d["choices"]) for d in MC) + len(GEN) + len(PPL)

    samples = {p.name.split("_tiny_")[1].split("_")[0]: [json.loads(line) for line in p.read_text().splitlines()]
               for p in out.rglob("samples_*.jsonl")}
    assert sorted(samples) == ["gen", "mc", "ppl"]
    # lm-eval's log-likelihoods against the offline engine's prompt log-probs of context + choice (lm-eval sends
    # the tokens without BOS: add_bos_token is off by default).
    tok = ByteTokenizer()
    offline = LLM("tiny", **KW)
    for s in sorted(samples["mc"], key=lambda s: s["doc_id"]):
        doc = MC[s["doc_id"]]
        ctx = tok.encode(doc["question"], add_special_tokens=False)
        conts = [tok.encode(c, add_special_tokens=False) for c in doc["choices"]]
        # One request at a time, as lm-eval sent them (batch_size=1, num_concurrent=1): the same float32 sums.
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        refs = [offline.generate([ctx + c], params)[0] for c in conts]
        want = [sum(d[t] for t, d in zip(r.prompt_token_ids[len(ctx):], r.prompt_logprobs[len(ctx):]))
                for r in refs]
        got = [float(resp[0][0]) for resp in s["resps"]]  # lm-eval writes them as strings
        assert got == want, (doc, got, want)
    # Perplexity: one window per text (they are short), scored after the BOS lm-eval puts first (its prefix token,
    # the tokenizer_info's bos_token).
    for s in samples["ppl"]:
        ids = [tok.bos_token_id] + tok.encode(PPL[s["doc_id"]]["text"], add_special_tokens=False)
        r = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
        assert float(s["resps"][0][0]) == sum(d[t] for t, d in zip(ids[1:], r.prompt_logprobs[1:]))
    # Its generations are the engine's greedy ones, stopped at lm-eval's `until` or its EOS string.
    assert len(samples["gen"]) == len(GEN)
    for s in samples["gen"]:
        ctx = tok.encode(GEN[s["doc_id"]]["question"], add_special_tokens=False)
        want = offline.generate([ctx], SamplingParams(max_tokens=8, temperature=0, stop=["\n", tok.eos_token]))
        assert s["resps"][0][0] == want[0].outputs[0].text
