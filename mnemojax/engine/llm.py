"""`LLM`: the offline library API, shaped like vLLM's."""
from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import time
from collections.abc import Callable, Mapping, Sequence

from tqdm import tqdm

from mnemojax.engine import beam_search as _beam
from mnemojax.engine.llm_engine import EngineConfig, LLMEngine, with_our_names
from mnemojax.scheduling.outputs import RequestOutput
from mnemojax.scheduling.sampling_params import BeamSearchParams, ParamError, RequestOutputKind, SamplingParams
from models.tokenizer import RENDER_ARGUMENTS

Prompt = str | Sequence[int]
log = logging.getLogger(__name__)


class _Progress:
    """`generate`'s progress bar (vLLM's): finished prompts of `total`, and the input (prompt) and output tokens per
    second of the finished ones since the call began. `use_tqdm`: True (a `tqdm` on stderr), a callable that makes
    the bar from tqdm's keyword arguments, or False (nothing)."""

    def __init__(self, use_tqdm, total: int):
        self.bar = None
        if use_tqdm:
            make = use_tqdm if callable(use_tqdm) else tqdm
            self.bar = make(total=total, desc="Processed prompts", dynamic_ncols=True,
                            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.start, self.tokens_in, self.tokens_out = time.perf_counter(), 0, 0

    def finished(self, requests) -> None:
        if self.bar is None or not requests:
            return
        self.tokens_in += sum(len(r.prompt_token_ids) for r in requests)
        self.tokens_out += sum(len(r.output_token_ids) for r in requests)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.tokens_in / elapsed:.2f} toks/s, "
                            f"output: {self.tokens_out / elapsed:.2f} toks/s")
        self.bar.update(len(requests))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _prompt_list(prompts, one: tuple = (str,)) -> list:
    """`prompts` as a list: one prompt (an instance of `one`, or token ids: Python or numpy integers, or a 1-D
    array) becomes a list of it."""
    if isinstance(prompts, one) or getattr(prompts, "ndim", None) == 1 or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    return list(prompts)


def _sequences(outs: list[RequestOutput]) -> RequestOutput:
    """The outputs of a prompt's n requests as one (vLLM's `n`): sequence j its output j."""
    if len(outs) == 1:
        return outs[0]
    return dataclasses.replace(outs[0], outputs=[dataclasses.replace(o.outputs[0], index=j)
                                                 for j, o in enumerate(outs)],
                               num_preemptions=sum(o.num_preemptions for o in outs))


class LLM:
    """Generates text for a list of prompts, batching them continuously.

    >>> llm = LLM(model="tiny")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].outputs[0].token_ids  # doctest: +SKIP

    Keyword arguments are the fields of `EngineConfig`: model ("tiny" or another preset, or a Hugging Face
    Llama directory), dtype, max_model_len, page_size, num_pages, chunk_size, max_num_batched_tokens,
    max_num_seqs, seed, block_pages, attention ("auto": the Mosaic GPU kernels on a Hopper GPU for a bf16/f16
    model they support, else the Pallas GPU kernels on an NVIDIA GPU, the reference elsewhere), and the parallel
    and scheduling settings; vLLM's `tensor_parallel_size`, `pipeline_parallel_size` and `block_size` are `tp`,
    `spp` and `page_size`.
    """

    def __init__(self, model: str = "tiny", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **with_our_names(kwargs)))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forgets every cached KV page, so later prompts are computed again (as after a weight update).
        Between `generate` calls no request runs, so nothing else changes; True, as vLLM's when it succeeds."""
        self.engine.reset_prefix_cache()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no `sampling_params` (vLLM's): the model's generation_config.json
        defaults (`generation_config`, default auto) over `SamplingParams()`'s."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: Prompt | Mapping | Sequence[Prompt | Mapping],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, *,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in prompt order.

        `prompts` is a string, a list of token ids, vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}` (the ids
        when both are there; the text is the output's `prompt`), or a list of these. Every prompt is validated
        before any is queued: a bad one raises ValueError (naming the field and the limit) and nothing is left
        behind.
        A prompt whose params have `n` > 1 runs as n engine requests (vLLM's fan-out; sequence j with seed + j when
        seeded) and returns them as its output's `outputs`, indexes 0..n-1 (the request id, metrics and cached
        tokens those of sequence 0; the preemptions summed).
        `use_tqdm` (vLLM's): True shows a progress bar of the finished sequences on stderr, with the input and
        output tokens per second so far; a callable (`functools.partial(tqdm, leave=False)`) makes the bar; False
        none.
        `priority` (vLLM's): one integer per prompt, lower first, under scheduler_policy "priority" (vLLM's
        `scheduling_policy`); with any other policy every one must be 0.
        """
        prompts = _prompt_list(prompts, (str, Mapping))
        if priority is not None and (isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence)
                                     or len(priority) != len(prompts)):
            raise ParamError("priority", f"priority must be a list of one integer per prompt ({len(prompts)}), got "
                                         f"{priority!r}")
        priority = [0] * len(prompts) if priority is None else list(priority)
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
                p.validate()  # n and the seeds of its sequences (fields may have changed since it was made)
                engine.validate(token_ids[-1], p if p.n == 1 else dataclasses.replace(p, n=1), priority[i])
            except ValueError as e:
                raise ParamError(getattr(e, "param", None), f"prompts[{i}]: {e}") from None
        # Only the final outputs are returned: the engine builds no output in the steps before (vLLM does the same).
        # n > 1: one request per sequence, sequence j drawing with seed + j.
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY).sequences() for p in params}
        groups = [[engine.add_request(prompt, p, prompt_token_ids=t, priority=rank) for p in final[id(params_i)]]
                  for prompt, params_i, t, rank in zip(prompts, params, token_ids, priority)]
        ids = [rid for group in groups for rid in group]
        pending = set(ids)
        bar = _Progress(use_tqdm, len(ids))
        try:
            while pending:
                engine.step()
                done = [rid for rid in pending if engine.requests[rid].is_finished]
                pending.difference_update(done)
                bar.finished([engine.requests[rid] for rid in done])
            engine.drain()  # a step launched after the last one finished computed nothing anyone needs: let it end
        except BaseException:  # a failed step (the engine has recovered) or a KeyboardInterrupt: this call's
            for rid in ids:    # requests end here, their pages back, and the next call starts clean
                engine.abort(rid)
                engine.pop_finished(rid)
            raise
        finally:
            bar.close()
        return [_sequences([engine.pop_finished(rid) for rid in group]) for group in groups]

    def beam_search(self, prompts: Prompt | Mapping | Sequence[Prompt | Mapping], params: BeamSearchParams,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[_beam.BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best sequences of each prompt (`mnemojax.engine.
        beam_search` has the algorithm), one `BeamSearchOutput` per prompt, in prompt order. A prompt is a string,
        token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}` (the ids when both are there). EOS is
        the tokenizer's `eos_token_id`, as vLLM's (without a tokenizer, the model's first EOS). Each prompt must
        leave room for `max_tokens` tokens within max_model_len (a ParamError naming `prompts[i]`, as `generate`'s).
        `concurrency_limit` (vLLM's): search that many prompts at a time, each group to its end before the next
        (None: all at once); `use_tqdm`: a bar over each group's steps (vLLM's: off with a `concurrency_limit`, with
        a warning)."""
        if not isinstance(params, BeamSearchParams):
            raise ParamError("params", f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool)
                                              or not isinstance(concurrency_limit, numbers.Integral)
                                              or concurrency_limit < 1):
            raise ParamError("concurrency_limit", f"concurrency_limit must be None or an integer >= 1, got "
                                                  f"{concurrency_limit!r}")
        if use_tqdm and concurrency_limit is not None:
            log.warning("Progress bar is not supported when using concurrency_limit. Disabling progress bar.")
            use_tqdm = False
        prompts = _prompt_list(prompts, (str, Mapping))
        engine, token_ids = self.engine, []
        longest = SamplingParams(max_tokens=params.max_tokens)
        for i, prompt in enumerate(prompts):
            try:  # a dict: vLLM's TextPrompt or TokensPrompt (its ids win over a "prompt" beside them)
                token_ids.append(engine.tokenize(prompt))
                engine.validate(token_ids[-1], longest)  # room for every step's prompt: the beam's tokens
            except ValueError as e:
                raise ParamError(getattr(e, "param", None), f"prompts[{i}]: {e}") from None
        tok, eos = engine.tokenizer, engine.eos_token_id
        decode = None if tok is None else (lambda ids: tok.decode(ids, skip_special_tokens=False))
        generate = functools.partial(self.generate, use_tqdm=False)  # one step: no bar of its own (vLLM's)
        limit = concurrency_limit or max(len(token_ids), 1)
        return [out for start in range(0, len(token_ids), limit)
                for out in _beam.beam_search(generate, token_ids[start:start + limit], params, eos, decode,
                                             use_tqdm=use_tqdm)]

    def chat(self, messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             add_special_tokens: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of `{"role", "content"}` messages) or a list of them, each
        through the tokenizer's chat template (`chat_template`: another Jinja template; `chat_template_kwargs`:
        more template variables), then `generate` on the token ids; one `RequestOutput` per conversation. A
        message's content is a string or a list of `{"type": "text", "text"}` parts, joined by newlines (vLLM's).
        `continue_final_message` leaves the last message open for the reply to continue (not with
        `add_generation_prompt`); `add_special_tokens` adds the tokenizer's special tokens (BOS) to the
        template's own. Raises ParamError naming the argument for a bad one (the built-in tiny model's byte
        tokenizer has a fixed template: another `chat_template` is one). `use_tqdm` as `generate`'s."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ParamError("messages", f"model {self.engine.config.model!r} has no tokenizer, so no chat template; "
                                         f"give token ids to generate")
        if not messages:
            raise ParamError("messages", "messages must not be empty")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            if not conversation:
                raise ParamError("messages", f"conversation {i} has no message")
            try:
                prompts.append(render_chat(tok, [_template_message(m) for m in conversation],
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                           add_special_tokens=add_special_tokens,
                                           template_field="messages" if chat_template is None else "chat_template"))
            except ParamError as e:
                raise ParamError(e.param, f"conversation {i}: {e}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None, documents=None,
                chat_template_kwargs: dict | None = None, add_special_tokens: bool = False,
                template_field: str = "messages") -> list[int]:
    """The token ids of `messages` (`{"role", "content"}` with string content) through `tokenizer`'s chat template
    (`chat_template`: another one), as vLLM renders a chat: `apply_chat_template` to text, then `encode` with
    `add_special_tokens` (false: the template writes BOS itself). `LLM.chat` and the server's chat and /tokenize
    share it. Raises ParamError naming `chat_template_kwargs` (a key that is one of the call's own arguments),
    `continue_final_message` (with `add_generation_prompt`, vLLM's rule), or `template_field` for a template that
    fails (the caller's field to blame: `messages`, or `chat_template` when the caller gave the template)."""
    reserved = sorted(set(chat_template_kwargs or ()) & RENDER_ARGUMENTS)
    if reserved:
        raise ParamError("chat_template_kwargs", f"chat_template_kwargs may not set {reserved}: they are the chat "
                                                 f"template call's own arguments")
    if continue_final_message and add_generation_prompt:
        raise ParamError("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                   "true (add_generation_prompt is true unless set to false)")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, documents=documents,
                                             chat_template=chat_template, tokenize=False,
                                             **(chat_template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - a template error is the caller's messages (or template)
        raise ParamError(template_field, f"{template_field}: the chat template failed: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _template_message(message: Mapping) -> dict:
    """A message as a chat template reads it: its content a string (text parts joined by newlines, vLLM's)."""
    if not isinstance(message, Mapping):
        raise ParamError("messages", f"a message is a mapping with 'role' and 'content', got {type(message).__name__}")
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str)
               for p in content):
            raise ParamError("messages", "a message's content parts must all be {'type': 'text', 'text': str}")
        content = "\n".join(p["text"] for p in content)
    return {**message, "content": "" if content is None else content}
