"""`LLM`: the offline library API, shaped like vLLM's."""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
from mnemojax.scheduling.outputs import RequestOutput
from mnemojax.scheduling.sampling_params import ParamError, RequestOutputKind, SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Generates text for a list of prompts, batching them continuously.

    >>> llm = LLM(model="tiny")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].outputs[0].token_ids  # doctest: +SKIP

    Keyword arguments are the fields of `EngineConfig`: model ("tiny" or another preset, or a Hugging Face
    Llama directory), dtype, max_model_len, page_size, num_pages, chunk_size, max_num_batched_tokens,
    max_num_seqs, seed, block_pages, attention ("auto": the Mosaic GPU kernels on a Hopper GPU for a bf16/f16
    model they support, else the Pallas GPU kernels on an NVIDIA GPU, the reference elsewhere), and the parallel
    and scheduling settings.
    """

    def __init__(self, model: str = "tiny", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no `sampling_params` (vLLM's): the model's generation_config.json
        defaults (`generation_config`, default auto) over `SamplingParams()`'s."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in prompt order.

        `prompts` is a string, a list of token ids, or a list of either. Every prompt is validated before any
        is queued: a bad one raises ValueError (naming the field and the limit) and nothing is left behind.
        """
        if isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1 or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # one prompt (token ids: Python or numpy integers, or a 1-D array)
        prompts = list(prompts)
        default = sampling_params is None  # then each prompt's own (`LLMEngine.default_sampling_params`)
        params = [None] * len(prompts) if default else list(sampling_params) \
            if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        engine = self.engine
        token_ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                token_ids.append(engine.tokenize(prompt))
                if default:
                    p = params[i] = engine.default_sampling_params(len(token_ids[-1]))
                engine.validate(token_ids[-1], p)
            except ValueError as e:
                raise ParamError(getattr(e, "param", None), f"prompts[{i}]: {e}") from None
        # Only the final outputs are returned: the engine builds no output in the steps before (vLLM does the same).
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]
        ids = [engine.add_request(prompt, p, prompt_token_ids=t)
               for prompt, p, t in zip(prompts, params, token_ids)]
        pending = set(ids)
        try:
            while pending:
                engine.step()
                pending = {rid for rid in pending if not engine.requests[rid].is_finished}
            engine.drain()  # a step launched after the last one finished computed nothing anyone needs: let it end
        except BaseException:  # a failed step (the engine has recovered) or a KeyboardInterrupt: this call's
            for rid in ids:    # requests end here, their pages back, and the next call starts clean
                engine.abort(rid)
                engine.pop_finished(rid)
            raise
        return [engine.pop_finished(rid) for rid in ids]
