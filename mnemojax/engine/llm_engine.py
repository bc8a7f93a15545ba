"""The engine: requests in, outputs out. Each `step()` is: schedule, execute, update."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import numbers
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mnemojax.cli import VLLM_NAMES
from mnemojax.engine.detokenizer import Detokenizer
from mnemojax.engine.executor import Executor, Launched
from mnemojax.scheduling.kv_manager import KVCacheManager
from mnemojax.engine.loader import LoadedModel, engine_attention, load, with_dtype
from mnemojax.engine.sampler import NO_TOKEN
from mnemojax.scheduling.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mnemojax.engine.structured import RegexState, TokenGuide, TokenVocabulary, token_texts
from mnemojax.scheduling.regex import compiled
from mnemojax.scheduling.request import Request
from mnemojax.scheduling.sampling_params import ParamError, RequestOutputKind, SamplingParams, truncate_prompt
from mnemojax.scheduling.config import ParallelConfig, SchedulerConfig
from mnemojax.scheduling.calibration import Calibrator
from mnemojax.scheduling.predictor import HARDWARE, Predictor, default_profile, make_predictor
from mnemojax.scheduling.scheduler import Scheduler, StepPlan
from models.config import PRESETS, LlamaConfig, generation_defaults
from models.tokenizer import spaces_between_special_tokens_matter
from models.kernels import ATTENTION_IMPLS, AUTO, MOSAIC, PALLAS, REFERENCE, check_attention_impl

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
HARDWARE_NAMES = tuple(sorted(HARDWARE))


def _pages_per_seq(config, max_model_len: int) -> int:
    """Columns of a rank's page table: a whole request's pages, at most `max_tokens_per_kvp_rank`'s."""
    pages = -(-max_model_len // config.page_size)
    if config.max_tokens_per_kvp_rank is not None:
        pages = min(pages, config.max_tokens_per_kvp_rank // config.page_size)
    return pages


@dataclasses.dataclass(frozen=True)
class EngineConfig(SchedulerConfig, ParallelConfig):
    """Everything that shapes an engine. `LLM(...)` keyword arguments and `python -m mnemojax.serve` flags map
    onto these fields (the flags' help is each field's docstring). The scheduling and mesh fields are those of
    `mnemojax.scheduling.config.SchedulerConfig` and `ParallelConfig`, shared with the simulator's `SimConfig`."""

    model: str = "tiny"
    """Model: a preset (tiny, llama3-8b, llama3-70b, llama3.2-1b, llama3.2-3b), a Hugging Face Llama directory, or
    an Orbax checkpoint directory written by scripts/convert_checkpoint.py."""
    dtype: str = dataclasses.field(default=AUTO, metadata={"choices": (AUTO, *DTYPES)})
    """Parameters, activations and KV cache: auto (the default, as in vLLM and transformers 5) computes in the
    dtype the checkpoint's weights are stored in (bfloat16 for Llama 3's; float32 for float32 ones, for float16
    ones, which float32 holds exactly, where they differ, and for presets); the engine's config holds the resolved
    name."""
    max_model_len: int | None = None
    """Longest prompt + output of one request (default: min(the model's limit, 8192))."""
    page_size: int = 16
    """Tokens per KV page."""
    num_pages: int | None = None
    """KV pages per device, page 0 reserved (default: enough for 4 full-length requests)."""
    kv_memory_fraction: float | None = None
    """Instead of num_pages: this fraction of the device memory the weights leave (GPU/TPU only; raises on a CPU)."""
    seed: int = 0
    """Random weights of presets, and sampling seeds of requests that give none."""
    block_pages: int = 8
    """KV pages per block of the reference attention."""
    attention: str = dataclasses.field(default=AUTO, metadata={"choices": ATTENTION_IMPLS})
    """Attention kernels: auto (mosaic on a Hopper GPU for a bf16/f16 model whose shapes and page size they
    support, else pallas on an NVIDIA GPU, reference elsewhere), reference (jax.numpy, any backend), pallas (Pallas
    Triton GPU kernels, NVIDIA only: raises elsewhere), mosaic (Pallas Mosaic GPU kernels, Hopper only, bf16/f16),
    pallas_interpret / mosaic_interpret (the same kernels interpreted; slow, for tests)."""
    hardware: str | None = dataclasses.field(default=None, metadata={"choices": HARDWARE_NAMES})
    """Runtime predictor preset (default: detected from the device)."""
    predictor_profile: str | None = None
    """Fitted efficiency factors of the runtime predictor: a profile name or a JSON path
    (scripts/profile_predictor.py)."""
    calibrate: bool = True
    """With target_batch_time_ms: refit the runtime predictor's factors online from every step's measured time
    (mnemojax.scheduling.calibration), starting from predictor_profile (or the hardware's shipped profile)."""
    save_predictor_profile: str | None = None
    """With calibrate: write the calibrated profile to this JSON path (at most every 10 s while serving, and on
    `LLMEngine.save_predictor_profile()`); give it back as predictor_profile to start calibrated."""
    precompile: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("MNEMOJAX_PRECOMPILE", "1").strip().lower() not in ("0", "false"))
    """Compile the step of every shape bucket before serving, so no step compiles later (default true;
    MNEMOJAX_PRECOMPILE=0 makes the default false). False: each shape compiles the first time a step needs it."""
    precompile_structured_outputs: bool = False
    """With precompile: also compile each shape's variant for steps with structured outputs' rows (regex, json and
    json_object requests carry token masks, which are their own compiled step), so the first such request compiles
    nothing either; the precompile takes about twice as long. Without it, each shape's variant compiles the first time
    a step with such a row needs it."""
    async_scheduling: bool | None = None
    """Overlap the host with the device (vLLM's async scheduling): step N+1 is scheduled and its arrays prepared
    and launched while step N runs, and a token step N samples enters step N+1 on the device; results are the
    same. A request that stops on a token (EOS, a stop token or string) has one more token computed and thrown
    away. Default (None): on, except in multi-host serving, which does not support it (true there raises)."""
    generation_config: str = "auto"
    """Where requests' sampling defaults come from (vLLM's --generation-config): auto (the model directory's
    generation_config.json: the temperature, top_p, top_k, min_p and max_new_tokens its creator chose, for a request that
    does not set them; the server also caps every request's max_tokens at max_new_tokens, as vLLM's does), vllm
    (none: SamplingParams' and the OpenAI API's own defaults), or a directory holding a generation_config.json."""
    max_logit_bias: int = 16
    """The most tokens one request's sampling may bias in a step: its logit_bias entries, plus, until min_tokens
    tokens are generated, the stop tokens min_tokens bans (EOS and stop_token_ids), plus its bad words' bans (a
    token for each word of one token, a slot for each longer one). Every step carries this many
    (token, bias) slots per logits row; a request needing more is refused, naming the field and this limit."""
    compilation_cache_dir: str = "~/.cache/mnemojax/jax"
    """JAX's persistent compilation cache, so a restart loads compiled steps instead of compiling them again;
    empty: none. A cache directory already set in jax's config wins."""

    def __post_init__(self):
        SchedulerConfig.__post_init__(self)
        ParallelConfig.__post_init__(self)
        if self.dtype not in (AUTO, *DTYPES):
            raise ValueError(f"dtype must be one of {(AUTO, *DTYPES)}, got {self.dtype!r}")
        if self.precompile_structured_outputs and not self.precompile:
            raise ValueError("precompile_structured_outputs needs precompile (MNEMOJAX_PRECOMPILE=0 makes precompile's "
                             "default false)")
        if isinstance(self.max_logit_bias, bool) or not isinstance(self.max_logit_bias, int) \
                or self.max_logit_bias < 0:
            raise ValueError(f"max_logit_bias must be an integer >= 0, got {self.max_logit_bias!r}")
        for name in ("page_size", "block_pages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        check_attention_impl(self.attention)
        if not self.uses_predictor:  # nothing would read them: refused rather than ignored
            for name in ("hardware", "predictor_profile", "save_predictor_profile"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is set, but no runtime predictor is built: it serves "
                                     f"target_batch_time_ms and ttft_slo_prefill_factor, and both are off")
        if self.kv_memory_fraction is not None:
            if self.num_pages is not None:
                raise ValueError("give num_pages or kv_memory_fraction, not both")
            if not 0 < self.kv_memory_fraction <= 1:
                raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")


@dataclasses.dataclass
class _Launch:
    """A step the engine launched: the executor's handle, and what calibration needs to time it."""

    launched: Launched
    shapes: list | None  # the chunk shapes the predictor costs the step by (None without calibration)
    start: float  # the engine's clock when the launch began
    first_of_shape: bool  # it ran a step shape for the first time (compiled or loaded it)
    queued_behind: bool  # async: launched while the previous launch was not collected (the device had work)


def detect_hardware() -> str:
    """The runtime predictor's hardware preset for the first device: "h200", "h100", "a100" or "cpu"."""
    kind = jax.devices()[0].device_kind.lower()
    for name in ("h200", "h100", "a100"):
        if name in kind:
            return name
    if jax.devices()[0].platform == "cpu":
        return "cpu"
    raise ValueError(f"no runtime predictor preset for device {kind!r}: pass hardware= (a100, h100, h200, cpu)")


def with_our_names(kwargs: dict) -> dict:
    """Engine keyword arguments with vLLM's names (`mnemojax.cli.VLLM_NAMES`) turned into ours; a setting given
    under both names is a ParamError naming them."""
    out = dict(kwargs)
    for theirs, ours in VLLM_NAMES.items():
        if theirs in out:
            if ours in out:
                raise ParamError(ours, f"{ours} and {theirs} (vLLM's name for it) are both given")
            out[ours] = out.pop(theirs)
    return out


def prompt_parts(prompt) -> tuple[str | None, str | Sequence[int]]:
    """A prompt in any of vLLM's forms (a string, token ids, or a dict: `TextPrompt` {"prompt": text} or
    `TokensPrompt` {"prompt_token_ids": ids}, which may carry its "prompt" text too) as (the text a request's output
    shows as its `prompt`, what to tokenize: the ids when there are any). A dict with other keys (vLLM's
    multi-modal data, say) is a ParamError naming them: nothing is dropped unread."""
    if not isinstance(prompt, Mapping):
        return (prompt if isinstance(prompt, str) else None), prompt
    other = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
    if other or ("prompt" not in prompt and "prompt_token_ids" not in prompt):
        raise ParamError("prompt", f"a dict prompt has 'prompt' (text) or 'prompt_token_ids' (vLLM's TextPrompt, "
                                   f"TokensPrompt) and nothing else, got {sorted(map(str, prompt))}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ParamError("prompt", f"a dict prompt's 'prompt' is a string, got {type(text).__name__}")
    return text, prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else text


def bad_word_sequences(tokenizer, words: Sequence[str]) -> list[tuple[int, ...]]:
    """The token sequences of bad `words`, as vLLM's `SamplingParams.update_from_tokenizer` makes them: each word, its
    leading spaces stripped, encoded without special tokens (the word at the start of a text); and once more after
    one space, kept when that gives as many tokens and another first one (the word inside a text, for a tokenizer
    whose words carry their leading space)."""
    seqs = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        seqs.append(tuple(plain))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(tuple(spaced))
    return seqs


class LLMEngine:
    """Requests in, outputs out: a scheduler, a KV page manager and an executor over loaded parts.

    `loaded` is what `mnemojax.engine.loader.load(config)` resolved (model, mesh, weights, tokenizer, KV sizing); given,
    nothing is loaded again. `channel` (multi-host serving: process 0's `mnemojax.engine.multihost.Leader`) receives every
    step's arrays so the other processes run the same step. `clock` (seconds, default `time.perf_counter`) times
    requests (their metrics, ILRS deadlines) and the steps calibration measures; a test or simulation may pass a
    virtual one.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *, channel=None,
                 clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.default_sampling = self._generation_defaults(config)  # before loading: a bad one is refused at once
        loaded = loaded if loaded is not None else load(config)
        if config.dtype == AUTO:
            config = dataclasses.replace(config, dtype=loaded.spec.dtype)
        self.config = config
        self.model_config: LlamaConfig = loaded.model_config
        self.max_model_len = loaded.max_model_len
        self.mesh = loaded.mesh
        self.tokenizer = loaded.tokenizer
        # set once here: `validate` reads it from other threads (AsyncLLM's) while the engine's uses the tokenizer
        self.spaces_matter = spaces_between_special_tokens_matter(self.tokenizer)
        pages_per_seq = _pages_per_seq(config, self.max_model_len)
        self.kv = KVCacheManager(config.kvp, loaded.num_pages, config.page_size, config.max_tokens_per_kvp_rank,
                                 prefix_caching=config.enable_prefix_caching)
        self.executor = Executor(loaded.spec, loaded.params, self.mesh, num_pages=loaded.num_pages,
                                 page_size=config.page_size, max_num_seqs=config.max_num_seqs,
                                 max_pages_per_seq=pages_per_seq, max_num_batched_tokens=config.max_num_batched_tokens,
                                 max_tokens_per_rank=config.max_tokens_per_kvp_rank, table=loaded.table,
                                 channel=channel, max_logit_bias=config.max_logit_bias)
        if config.async_scheduling and (channel is not None or jax.process_count() > 1):
            raise ValueError("async_scheduling is not supported in multi-host serving: leave it unset or false")
        self.async_scheduling = config.async_scheduling is not False and channel is None \
            and jax.process_count() == 1
        self._launched: _Launch | None = None  # async scheduling: the step launched and not yet collected
        self._last_wait_end = 0.0  # when the last collect's wait ended
        # whom the last failed step's `_recover` preempted; None before it has recovered from one
        self.last_failure_preempted: list[str] | None = None
        # before the precompile (minutes on a GPU): a bad profile or hardware is refused first
        self.predictor = self._make_predictor(config, self.model_config, runs=loaded.spec.attention) \
            if config.uses_predictor else None
        if config.precompile:
            self.precompile()
        self.scheduler = Scheduler(config, self.kv, self.predictor, clock=clock,
                                   eos_token_ids=self.model_config.eos_token_ids, spp=config.spp,
                                   max_model_len=self.max_model_len)
        self.calibrator = Calibrator(self.predictor) if self.predictor is not None and config.calibrate else None
        self._in_flight_shapes: collections.deque = collections.deque(maxlen=config.spp)
        self._profile_saved_at = time.monotonic()
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, Detokenizer] = {}  # of unfinished requests, when there is a tokenizer
        self._token_vocab: TokenVocabulary | None = None  # the tokens' texts, for regexes (made when first asked)
        self._guides: collections.OrderedDict[str, TokenGuide] = collections.OrderedDict()  # the latest patterns'
        self._guides_lock = threading.Lock()
        self._delta_sent: dict[str, tuple[int, int, int, float]] = {}  # DELTA requests: prompt log-probs, tokens,
        # chars sent, and the generated tokens' summed log-probs
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)

    def precompile(self) -> float:
        """Compiles the step of every shape the engine can meet (`Executor.shape_buckets`), with a progress bar;
        returns the seconds it took. Called by the constructor when `config.precompile`."""
        from tqdm import tqdm

        start = time.perf_counter()
        shapes = self.executor.shape_buckets()
        masked = self.config.precompile_structured_outputs
        with tqdm(total=len(shapes) * (1 + masked), desc="compiling step shapes", unit="shape", leave=False) as bar:
            self.executor.warm_up(progress=bar.update, masked=masked)
        took = time.perf_counter() - start
        logger.info("compiled %d step shapes%s in %.1f s (token rows %s)", len(shapes),
                    " and their structured outputs' variants" if masked else "", took,
                    sorted({T for T, *_ in shapes}))
        return took

    @staticmethod
    def _generation_defaults(config: EngineConfig) -> dict:
        """`SamplingParams` fields the model's generation_config.json sets (`EngineConfig.generation_config`)."""
        source = config.generation_config
        if source == "vllm" or (source == "auto" and (config.model in PRESETS or not os.path.isdir(config.model))):
            return {}  # a preset (or no such directory, which loading names)
        path = config.model if source == "auto" else source
        if not os.path.isdir(path):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding a "
                             f"generation_config.json, got {source!r}")
        defaults = generation_defaults(path)
        try:
            SamplingParams(**defaults)
        except ParamError as e:  # named as the file spells it
            key = "max_new_tokens: " if e.param == "max_tokens" else ""
            raise ValueError(f"{os.path.join(path, 'generation_config.json')}: {key}{e}") from None
        if defaults:
            logger.warning("requests' sampling defaults from %s: %s (generation_config='vllm' ignores them)",
                           os.path.join(path, "generation_config.json"), defaults)
        return defaults

    def default_sampling_params(self, num_prompt_tokens: int | None = None) -> SamplingParams:
        """The sampling parameters of a request that gives none: the model's generation defaults
        (`generation_config`) over `SamplingParams()`'s; for a prompt of `num_prompt_tokens`, the model's
        max_new_tokens capped at the room the prompt leaves (the user asked for none: as the server's cap)."""
        defaults = dict(self.default_sampling)
        if "max_tokens" in defaults and num_prompt_tokens is not None:
            room = self.max_request_tokens - num_prompt_tokens
            defaults["max_tokens"] = max(min(defaults["max_tokens"], room), 1)
        return SamplingParams(**defaults)

    @property
    def eos_token_id(self) -> int | None:
        """The EOS a beam ends at (vLLM's beam search: the tokenizer's `eos_token_id`); without a tokenizer, the
        model's first EOS."""
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_id
        return next(iter(self.model_config.eos_token_ids), None)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + max_tokens) one request can hold: `max_model_len`, or fewer when the KV pages
        (a request's rank, or kvp x max_tokens_per_kvp_rank) hold fewer."""
        return min(self.max_model_len, self.kv.max_request_tokens())

    @staticmethod
    def _make_predictor(config: EngineConfig, mc: LlamaConfig, runs: str | None = None):
        """The runtime predictor for this engine; `runs`: the attention its executor runs (default: what `config`
        resolves to for `mc`), costed whatever the preset's profile says."""
        config = with_dtype(config)
        hardware = config.hardware or detect_hardware()
        profile = config.predictor_profile or default_profile(hardware)
        pages_per_seq = _pages_per_seq(config, config.max_model_len or mc.max_position_embeddings)
        runs = engine_attention(config, mc) if runs is None else runs
        if profile is not None:
            try:  # read once here to name the flag; an unreadable or malformed profile says so
                profile = Predictor.load_profile(profile)
            except (OSError, ValueError) as e:
                raise ValueError(f"predictor_profile {profile!r}: {e}") from None
        # the executor runs every micro-batch at the pipeline register's size when spp > 1
        return make_predictor(config, mc, hardware=hardware, dtype_bytes=jnp.dtype(config.dtype).itemsize,
                              profile=profile, pipeline_padding=config.spp > 1,
                              block_tokens=min(config.block_pages, pages_per_seq) * config.page_size,
                              attention=runs if runs in (PALLAS, MOSAIC, REFERENCE) else None)

    # ---------------------------------------------------------------- requests in
    def tokenize(self, prompt: str | Sequence[int] | Mapping) -> list[int]:
        """A prompt's token ids (a string through the tokenizer, BOS included; any of `prompt_parts`' forms)."""
        prompt = prompt_parts(prompt)[1]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", f"model {self.config.model!r} has no tokenizer: give prompts as token ids")
            return list(self.tokenizer.encode(prompt))
        return self._token_ids(prompt, "prompt")

    @staticmethod
    def _token_ids(prompt, field: str) -> list[int]:
        """`prompt`'s token ids as Python ints; a ParamError naming `field` if it is not a sequence of integers."""
        try:
            ids = list(prompt)
        except TypeError:
            raise ParamError(field, f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}") \
                from None
        if all(type(t) is int for t in ids):
            return ids
        for i, t in enumerate(ids):  # numpy integers are ids too; a float or a bool is not (no silent int())
            if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                raise ParamError(field, f"prompt token ids must be integers; index {i} is {t!r} "
                                        f"({type(t).__name__})")
        return [int(t) for t in ids]

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raises ValueError naming the field and the limit; changes nothing."""
        vocab = self.model_config.vocab_size
        params.validate(vocab_size=vocab)
        self.check_priority(priority)
        if params.n != 1:
            raise ParamError("n", f"an engine request makes one sequence, so n must be 1 here (got {params.n}): "
                                  f"LLM.generate and AsyncLLM.generate make n requests for n > 1, as the server's "
                                  f"n does")
        if not params.spaces_between_special_tokens and self.spaces_matter:
            raise ParamError("spaces_between_special_tokens", "spaces_between_special_tokens false is not supported "
                                                              "with this tokenizer, whose decode puts spaces between "
                                                              "special tokens by default (a slow tokenizer under "
                                                              "transformers 4)")
        if params.stop and self.tokenizer is None:
            raise ParamError("stop", f"model {self.config.model!r} has no tokenizer, so stop strings cannot be "
                                     f"matched: use stop_token_ids")
        if not prompt_ids:
            raise ParamError("prompt", "prompt must not be empty")
        for i, t in enumerate(prompt_ids):
            if not 0 <= t < vocab:
                raise ParamError("prompt", f"prompt token id {t} at index {i} is outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ParamError("prompt", f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                                       f"{total} exceeds max_model_len ({self.max_model_len})")
        why = self.kv.capacity_error(total)
        if why is not None:
            raise ParamError("prompt", f"prompt + max_tokens: {why}")
        biased = set(params.logit_bias or ())
        banned = set(self._stop_ids(params)) if params.min_tokens else set()
        allowed = params.allowed_token_ids
        words, sequences = self.bad_words(params)
        limit = self.config.max_logit_bias
        if params.structured_outputs is not None:
            self.choice_steps(params)  # its checks
            self.regex_guide(params)
        if allowed is not None:  # its slots are the allowed tokens; biases and bans elsewhere change nothing
            if len(allowed) > limit:
                raise ParamError("allowed_token_ids", f"allowed_token_ids ({len(allowed)} tokens) are more than "
                                                      f"max_logit_bias ({limit}, an engine setting: each is a slot "
                                                      f"of the logits row)")
            if (banned or words) and set(allowed) <= banned | words:
                why = " or ".join(([f"a stop token that min_tokens ({params.min_tokens}) bans until then"]
                                   if banned else []) + (["a bad word"] if words else []))
                raise ParamError("allowed_token_ids", f"every allowed token is {why}, so none could be generated")
            if len(allowed) + len(sequences) > limit:
                raise ParamError("bad_words", f"allowed_token_ids ({len(allowed)} tokens) and the bad words of more "
                                              f"than one token ending in one of them ({len(sequences)}) need "
                                              f"{len(allowed) + len(sequences)} slots, more than max_logit_bias "
                                              f"({limit}, an engine setting)")
        elif len(biased | banned | words) + len(sequences) > limit:
            field = "bad_words" if words or sequences else "logit_bias" if biased else "min_tokens"
            extra = f", the bad words' single tokens ({len(words)}) and sequences ({len(sequences)})" \
                if field == "bad_words" else ""
            raise ParamError(field, f"logit_bias ({len(biased)} tokens){extra} and the stop tokens min_tokens bans "
                                    f"({len(banned)}) bias {len(biased | banned | words) + len(sequences)} tokens, "
                                    f"more than max_logit_bias ({limit}, an engine setting)")

    def _structured_eos(self, kind: str) -> tuple[int, ...]:
        """The EOS tokens that end structured outputs of `kind` (`StructuredOutputsParams.kind`); ParamError naming
        `structured_outputs` when the model has no tokenizer (the kind needs token texts) or no EOS."""
        if self.tokenizer is None:
            raise ParamError("structured_outputs", f"model {self.config.model!r} has no tokenizer, which "
                                                   f"structured_outputs.{kind} needs")
        eos = tuple(sorted(self.model_config.eos_token_ids))
        if not eos:
            raise ParamError("structured_outputs", f"the model has no EOS token to end structured_outputs.{kind} "
                                                   f"with")
        return eos

    def choice_steps(self, params: SamplingParams) -> dict[tuple[int, ...], tuple[int, ...]] | None:
        """Structured outputs' choices (`params.structured_outputs.choice`) as the tokens allowed after each
        sequence of generated tokens that starts one: each choice is the tokenizer's encoding of it (no special
        tokens), and after a whole choice come the model's EOS tokens (and the tokens of the choices it starts).
        None without structured outputs. Raises ParamError naming `structured_outputs`: no tokenizer, no EOS, a
        choice without tokens or with ids outside the vocabulary, or a step with more tokens than the logits row's
        max_logit_bias slots."""
        so = params.structured_outputs
        if so is None or so.choice is None:
            return None
        eos = self._structured_eos("choice")
        vocab, steps = self.model_config.vocab_size, {}
        for text in so.choice:
            try:
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            except ValueError as e:  # text no tokenizer takes (a lone surrogate from JSON's escapes)
                raise ParamError("structured_outputs", f"structured_outputs.choice {text!r} cannot be tokenized: "
                                                       f"{e}") from None
            if not ids or not all(0 <= t < vocab for t in ids):
                raise ParamError("structured_outputs", f"structured_outputs.choice {text!r} encodes to {list(ids)}: "
                                                       f"no tokens, or ids outside the vocabulary [0, {vocab})")
            for i in range(len(ids)):
                steps.setdefault(ids[:i], set()).add(ids[i])
            steps.setdefault(ids, set()).update(eos)
        limit = self.config.max_logit_bias
        most = max(len(v) for v in steps.values())
        if most > limit:
            raise ParamError("structured_outputs", f"structured_outputs.choice allow {most} tokens at one step, more "
                                                   f"than max_logit_bias ({limit}, an engine setting: each is a slot "
                                                   f"of the logits row)")
        return {k: tuple(sorted(v)) for k, v in steps.items()}

    MAX_GUIDES = 64
    """How many regexes' token guides (their per-state masks) the engine keeps for the next request with one."""

    def regex_guide(self, params: SamplingParams) -> TokenGuide | None:
        """The token guide of structured outputs' `regex`, `json` or `json_object` (None without one): per state of
        the pattern (`StructuredOutputsParams.pattern`: a JSON schema is written as one), the tokens whose text
        keeps a whole match possible, EOS where the text matches. Kept for the latest MAX_GUIDES patterns. Raises
        ParamError naming `structured_outputs`: no tokenizer, no EOS, a pattern that matches no string, or one no
        token of the vocabulary can start."""
        so = params.structured_outputs
        pattern = None if so is None else so.pattern
        if pattern is None:
            return None
        what = f"structured_outputs.regex {pattern!r}" if so.regex is not None else f"structured_outputs.{so.kind}"
        with self._guides_lock:  # the server's thread validates requests beside the engine's
            guide = self._guides.get(pattern)
            if guide is not None:
                self._guides.move_to_end(pattern)
                return guide
            eos = self._structured_eos(so.kind)
            rx = compiled(pattern)
            if not rx.start:
                raise ParamError("structured_outputs", f"{what} matches no string")
            if self._token_vocab is None:
                self._token_vocab = TokenVocabulary(token_texts(self.tokenizer, self.model_config.vocab_size))
            guide = TokenGuide(rx, self._token_vocab, eos)
            if not guide.mask(rx.start).any():
                raise ParamError("structured_outputs", f"{what}: no token of the vocabulary can start a match")
            self._guides[pattern] = guide
            while len(self._guides) > self.MAX_GUIDES:
                self._guides.popitem(last=False)
            return guide

    def bad_words(self, params: SamplingParams) -> tuple[set[int], list[tuple[tuple[int, ...], int]]]:
        """The bans of `params.bad_words` and `bad_words_token_ids`: (the tokens banned always, the sequences of
        more than one token as (prefix, last token), the last token banned where the tokens generated just before
        are the prefix). A sequence ending in an always-banned token, or (with `allowed_token_ids`) in a token not
        allowed, is left out: that token is never drawn anyway. Words become token sequences by
        `bad_word_sequences` (vLLM's rule)."""
        seqs = [tuple(q) for q in params.bad_words_token_ids or ()]
        if params.bad_words:
            if self.tokenizer is None:
                raise ParamError("bad_words", f"model {self.config.model!r} has no tokenizer, so bad words cannot be "
                                              f"tokenized: use bad_words_token_ids")
            seqs += bad_word_sequences(self.tokenizer, params.bad_words)
            vocab = self.model_config.vocab_size
            outside = sorted({t for q in seqs for t in q if not 0 <= t < vocab})
            if outside:  # a tokenizer larger than the model's embedding (vLLM's check)
                raise ParamError("bad_words", f"bad_words give token ids outside the vocabulary [0, {vocab}): "
                                              f"{outside}")
        words = {q[0] for q in seqs if len(q) == 1}
        allowed = params.allowed_token_ids
        sequences = sorted({(q[:-1], q[-1]) for q in seqs if len(q) > 1 and q[-1] not in words
                            and (allowed is None or q[-1] in allowed)})
        return words, sequences

    def _bias_slots(self, bias: dict[int, float], allowed: list[int] | None) -> tuple[np.ndarray, np.ndarray, bool]:
        """`bias` as a logits row's (token ids, biases, allow-only) slots, all of them: unused ones are `NO_TOKEN`,
        bias 0. With `allowed` (allowed_token_ids) the slots are those tokens, each with its bias (0 where none),
        and the row keeps only them."""
        if allowed is not None:
            bias = {t: bias.get(t, 0.0) for t in allowed}
        ids = np.full(self.executor.bias_slots, NO_TOKEN, np.int32)
        values = np.zeros(self.executor.bias_slots, np.float32)
        ids[:len(bias)], values[:len(bias)] = list(bias), list(bias.values())
        return ids, values, allowed is not None

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens `min_tokens` bans: EOS and the request's `stop_token_ids` (EOS even with `ignore_eos`, as
        vLLM's `all_stop_token_ids`)."""
        return tuple(sorted({*self.model_config.eos_token_ids, *params.stop_token_ids}))

    def add_request(self, prompt: str | Sequence[int] | Mapping, params: SamplingParams | None = None,
                    request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Queues a request; `prompt_token_ids`, when given, are `prompt` already tokenized. `arrival_time` (on the
        engine's clock, at most now; default now), as vLLM's: when the request arrived, which its TTFT and its ILRS
        deadline count from (a server or a trace replay that hands requests over late). `priority` (vLLM's): under
        scheduler_policy "priority", lower runs first (`check_priority`)."""
        text, prompt = prompt_parts(prompt)
        prompt_ids = self.tokenize(prompt) if prompt_token_ids is None else \
            self._token_ids(prompt_token_ids, "prompt_token_ids")
        params = params or self.default_sampling_params(len(prompt_ids))
        prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, self.max_model_len)
        self.validate(prompt_ids, params, priority)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        now = self.clock()
        if arrival_time is not None and not arrival_time <= now:
            raise ParamError("arrival_time", f"arrival_time {arrival_time} is later than the engine's clock ({now})")
        req = Request(rid, prompt_ids, params, now if arrival_time is None else arrival_time, seed, prompt=text,
                      priority=priority)
        allowed = params.allowed_token_ids
        words, req.bad_words = self.bad_words(params)
        req.choices = self.choice_steps(params)
        guide = self.regex_guide(params)
        req.regex = RegexState(guide) if guide is not None else None
        if params.logit_bias or params.min_tokens or allowed is not None or words or req.bad_words:
            bias = {**(params.logit_bias or {}), **dict.fromkeys(words, -math.inf)}  # -inf + a bias is -inf
            early = {**bias, **dict.fromkeys(self._stop_ids(params), -math.inf)} if params.min_tokens else bias
            # a request with bad words of several tokens has slots even without a bias: `prepare` adds their bans
            req.bias, req.bias_early = (self._bias_slots(b, allowed) if b or allowed is not None or req.bad_words
                                        else None for b in (bias, early))
        self.scheduler.add(req)
        self.requests[rid] = req
        if self.tokenizer is not None and params.detokenize:
            self._detokenizers[rid] = Detokenizer(self.tokenizer, params, prompt_ids)
        return rid

    def check_priority(self, priority) -> None:
        """A request's `priority` must be an integer, and 0 unless scheduler_policy is "priority" (vLLM's rule: the
        other policies order requests by themselves); raises ParamError naming `priority`."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ParamError("priority", f"priority must be an integer, got {priority!r}")
        policy = self.config.scheduler_policy
        if priority != 0 and policy != "priority":
            raise ParamError("priority", f"priority {priority} needs scheduler_policy 'priority' (vLLM's "
                                         f"--scheduling-policy priority); this engine's is {policy!r}")

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Ends a request that has not finished, freeing its pages; its finish reason is `reason` ("abort", or
        vLLM's "error": ended by the engine's failures)."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, reason)
            self._close_detokenizer(req)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached KV page (pages that running requests hold stay theirs); later requests compute their
        prompts again. Returns how many pages were cached."""
        return self.kv.reset_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.executor.has_in_flight() or self._launched is not None

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. Returns the outputs of requests that made progress (of a FINAL_ONLY request,
        only the one when it ends).

        With async scheduling the step launched here is collected (its tokens appended, its outputs returned) in
        the next call, after that call has launched its own: the outputs returned are the previous launch's.

        A step that fails (an exception, a KeyboardInterrupt during a compile) raises after `_recover`: every
        running request is then preempted by recompute, so the engine goes on serving and no page is lost."""
        with self._recovering():
            plan = self.scheduler.schedule()
            launch = None
            if not plan.is_empty or self.executor.has_in_flight():
                launch = self._launch(plan, fetch=not self.async_scheduling)
            if not self.async_scheduling:
                return [] if launch is None else self._collect(launch)
            previous, self._launched = self._launched, launch
            return [] if previous is None else self._collect(previous)

    def drain(self) -> list[RequestOutput]:
        """Collects the step launched and not yet collected (async scheduling), then runs empty steps until the
        pipeline's stages hold nothing (spp > 1), scheduling nothing new; returns their outputs. `LLM.generate`
        calls it when its requests are done, so nothing is left running and every page is back."""
        with self._recovering():
            previous, self._launched = self._launched, None
            outputs = [] if previous is None else self._collect(previous)
            while self.executor.has_in_flight():
                outputs += self._collect(self._launch(StepPlan([], []), fetch=True))
            return outputs

    def _launch(self, plan: StepPlan, fetch: bool) -> _Launch:
        """Launches `plan`'s step (`fetch`: its results fetched at once) with what calibration needs to time it."""
        shapes = self._step_shapes(plan) if self.calibrator is not None else None
        start = self.clock()
        launched = self.executor.launch(plan, fetch=fetch)
        if self.async_scheduling:
            for ch in launched.leaving.plan.chunks:
                ch.request.num_unfetched += ch.sample  # on the device until `_collect` takes it
        return _Launch(launched, shapes, start, self.executor.last_step_first_of_shape,
                       queued_behind=self._launched is not None)

    @contextlib.contextmanager
    def _recovering(self):
        """Runs a step's work; on any failure, `_recover` and re-raise."""
        try:
            yield
        except BaseException:
            self._recover()
            raise

    def _recover(self) -> None:
        """After a failed step what the device holds is unknown (the steps in flight are lost, and the KV cache with
        them when the step had taken it): the executor starts empty, every running request is preempted by
        recompute (exact: sampling is keyed by seed and token index), every finished one still in flight gives its
        pages back, and the prefix cache is forgotten. `last_failure_preempted` names the requests preempted once
        all that is done (None until then). Multi-host: nothing (the followers' state cannot follow)."""
        self.last_failure_preempted = None
        if self.executor.channel is not None:
            return
        logger.error("a step failed: every running request is preempted and computed again")
        self._launched = None
        self._in_flight_shapes.clear()
        for req in self.requests.values():
            req.num_unfetched = 0
        self.executor.reset()
        self.last_failure_preempted = [req.request_id for req in self.scheduler.preempt_all()]
        self.kv.reset_cache()

    def _collect(self, launch: _Launch) -> list[RequestOutput]:
        """Waits for a launched step's results and applies them: the update half of a step."""
        done, outputs = self.executor.collect(launch.launched)
        if self.calibrator is not None:
            self._calibrate(launch)
        if self.async_scheduling:
            for ch in done.chunks:
                ch.request.num_unfetched -= ch.sample
        gone = {id(ch.request) for ch in done.chunks if ch.request.is_finished}  # finished while in flight
        for req in self.scheduler.update_from_output(done, outputs):
            self._detokenize(req)
        return [self.output(ch.request) for ch in done.chunks if id(ch.request) not in gone
                and (ch.request.is_finished or ch.request.params.output_kind is not RequestOutputKind.FINAL_ONLY)]

    # ---------------------------------------------------------------- online calibration
    def _step_shapes(self, plan):
        """The chunk shapes `predictor.step_time` costs this step by: the slowest micro-batch in flight (the one
        entering now included), on its busiest KVP rank."""
        step_time = self.predictor.step_time
        entering = max(self.scheduler.plan_shapes(plan), key=step_time, default=[])
        self._in_flight_shapes.append(entering)
        return max(self._in_flight_shapes, key=lambda s: step_time(s) if s else 0.0)

    def _calibrate(self, launch: _Launch) -> None:
        """Feeds one step's time to the calibrator (every collect waits for its step to end). Synchronous: the
        wall time from launch to results, the host preparing the arrays included. Async: the time between the
        ends of two consecutive collects, that is the device time of the step (launched before the previous
        collect, it started when the previous step ended) or, when the host is slower, the time the host made it
        take. Left out: a step that ran a shape for the first time (a compile) and, async, one launched when
        nothing ran before it (its start is not measured)."""
        now, previous = self.clock(), self._last_wait_end
        self._last_wait_end = now
        start = (previous if launch.queued_behind else None) if self.async_scheduling else launch.start
        if start is None or launch.first_of_shape or not launch.shapes:
            return
        self._observe(launch.shapes, now - start)

    def _observe(self, shapes, seconds: float) -> None:
        """One measured step for the calibrator (and the profile saved, at most every 10 s, when asked)."""
        if self.calibrator.observe(shapes, seconds) and self.config.save_predictor_profile:
            if time.monotonic() - self._profile_saved_at >= 10.0:
                self.save_predictor_profile()

    def save_predictor_profile(self, path: str | None = None) -> dict | None:
        """Writes the (calibrated) predictor's profile to `path` (default `config.save_predictor_profile`), with
        how it was calibrated; returns what was written, or None without a predictor or path."""
        path = path or self.config.save_predictor_profile
        if self.predictor is None or not path:
            return None
        cal = self.calibrator
        info = self.predictor.save_profile(
            path, model=self.config.model, calibrated_from=self.config.predictor_profile or
            default_profile(self.predictor.hardware.name) or "defaults",
            calibration=None if cal is None else {
                "steps": cal.num_observed, "refits": cal.num_refits, "window": len(cal.samples),
                "median_error_last_64": cal.recent_error(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        self._profile_saved_at = time.monotonic()
        return info

    def prediction_error(self) -> float | None:
        """Median |predicted / measured - 1| of the recent measured steps (None without calibration or steps)."""
        return None if self.calibrator is None else self.calibrator.recent_error()

    def _detokenize(self, req: Request) -> None:
        """Text for `req`'s new token. A stop string it completes ends the request, and names the reason even
        when the token also stopped it otherwise (a length limit). A token that stopped it itself (EOS or one of
        `stop_token_ids`) stays in `token_ids` but adds no text unless `include_stop_str_in_output` (vLLM's)."""
        detok = self._detokenizers.get(req.request_id)
        if detok is None:
            return
        stopped_by_token = req.finish_reason == "stop" and not isinstance(req.stop_reason, str)
        new = [] if stopped_by_token and not req.params.include_stop_str_in_output else req.output_token_ids[-1:]
        stop = detok.add(new) if new else None
        req.output_text = detok.stable_text  # never shows what a later token could change
        if stop is not None:
            if req.is_finished:
                req.finish_reason, req.stop_reason = "stop", stop
            else:
                self.scheduler.finish(req, "stop", stop)
        if req.is_finished:
            self._close_detokenizer(req)

    def _close_detokenizer(self, req: Request) -> None:
        detok = self._detokenizers.pop(req.request_id, None)
        if detok is not None:
            detok.flush()
            req.output_text = detok.text

    # ---------------------------------------------------------------- outputs out
    def output(self, req: Request, kind: RequestOutputKind | None = None) -> RequestOutput:
        """What `req` has produced (`kind` defaults to its `params.output_kind`). CUMULATIVE (and FINAL_ONLY, whose
        one output is the last): everything so far.
        DELTA: only what is new since its previous output (the prompt's ids in the first one only), so a step's
        outputs cost what the step added, not copies of whole lists."""
        if (kind or req.params.output_kind) is RequestOutputKind.DELTA:
            return self._delta_output(req)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            outputs=[CompletionOutput(0, req.output_text, list(req.output_token_ids),
                                      None if req.logprobs is None else list(req.logprobs),
                                      req.finish_reason, req.stop_reason)],
            finished=req.is_finished,
            metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                   req.finished_time, list(req.token_times)),
            num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens or 0)

    def _delta_output(self, req: Request) -> RequestOutput:
        first = req.request_id not in self._delta_sent
        n_plp, n_tok, n_chr, running = self._delta_sent.get(req.request_id, (0, 0, 0, 0.0))
        plps = req.prompt_logprobs
        if req.logprobs is not None:
            for d, t in zip(req.logprobs[n_tok:], req.output_token_ids[n_tok:]):
                running += d[t]  # (token by token: the sum `cumulative_logprob` gives a CUMULATIVE output)
        self._delta_sent[req.request_id] = (len(plps or ()), len(req.output_token_ids), len(req.output_text),
                                            running)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt if first else None,
            prompt_token_ids=list(req.prompt_token_ids) if first else [],
            prompt_logprobs=None if plps is None else plps[n_plp:],
            outputs=[CompletionOutput(0, req.output_text[n_chr:], req.output_token_ids[n_tok:],
                                      None if req.logprobs is None else req.logprobs[n_tok:],
                                      req.finish_reason, req.stop_reason,
                                      None if req.logprobs is None else running)],
            finished=req.is_finished,
            metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                   req.finished_time, req.token_times[n_tok:]),
            num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens or 0)

    def pop_finished(self, request_id: str) -> RequestOutput:
        """The whole final output of a finished request (CUMULATIVE, whatever it asked for), forgetting it."""
        req = self.requests.pop(request_id)
        self._delta_sent.pop(request_id, None)
        return self.output(req, RequestOutputKind.CUMULATIVE)


def freeze_startup_objects() -> int:
    """Moves every object alive now (the loaded model, compiled steps, jax's and the server's own) out of the
    cyclic garbage collector's reach (`gc.collect()` then `gc.freeze()`, as vLLM does after start-up); returns how
    many. A full collection otherwise walks them all: on the tiny model with 256 requests decoding, 270,000
    tracked objects and pauses of up to ~200 ms inside a step (the TBT tail; `scripts/bench_host.py
    --freeze_gc`). For a long-lived server process; frozen objects that later become cyclic garbage are never
    freed, so a notebook that builds many engines should not call it."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
