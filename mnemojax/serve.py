"""`python -m mnemojax.serve`: the OpenAI-compatible HTTP server.

    python -m mnemojax.serve --model tiny --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'

Multi-host: start the same command on every process with `--coordinator_address host:port --num_processes N
--process_id i`; process 0 serves HTTP and schedules, the others run its steps (see `mnemojax.multihost`).

SIGTERM (or Ctrl-C) drains: new requests get 503, requests in flight may finish for `--shutdown_grace_s`, then
the rest are aborted with a final message (finish_reason "abort"), and the process exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import time

from absl import app, flags

from mnemojax.predictor import HARDWARE
from mnemojax.scheduler import POLICIES

_MODEL = flags.DEFINE_string("model", "tiny", "Model: a preset (tiny, llama3-8b, ...), a Hugging Face Llama "
                             "directory, or an Orbax checkpoint from scripts/convert_checkpoint.py.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameters, activations and KV cache.")
_TP = flags.DEFINE_integer("tp", 1, "Tensor parallelism.")
_SPP = flags.DEFINE_integer("spp", 1, "Sequence pipeline parallelism (pipeline stages).")
_KVP = flags.DEFINE_integer("kvp", 1, "KV-cache parallelism (ranks, each with its own page pool).")
_MAX_PER_RANK = flags.DEFINE_integer("max_tokens_per_kvp_rank", None,
                                     "Most tokens of one request on one KVP rank (default: no split).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", None, "Longest prompt + output (default: min(model's, 8192)).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "KV pages per device (default: 4 full-length requests, or "
                                  "--kv_memory_fraction).")
_KV_FRACTION = flags.DEFINE_float("kv_memory_fraction", None, "Size the KV cache to this fraction of the device "
                                  "memory left after the weights (needs a device that reports memory: GPU/TPU).")
_CHUNK = flags.DEFINE_integer("chunk_size", 256, "Largest prefill chunk of one request per step.")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget of a step.")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Requests in one step.")
_POLICY = flags.DEFINE_enum("scheduler_policy", "fcfs", list(POLICIES), "Prefill order.")
_TARGET = flags.DEFINE_float("target_batch_time_ms", None, "Adaptive chunking: a step's predicted time stays under "
                             "this (default: fixed chunks).")
_HARDWARE = flags.DEFINE_enum("hardware", None, sorted(HARDWARE), "Runtime predictor preset (default: detected).")
_SEED = flags.DEFINE_integer("seed", 0, "Random weights of presets, and seeds of requests that give none.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 to serve other machines).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_API_KEY = flags.DEFINE_string("api_key", None, "Require `Authorization: Bearer <key>` on /v1 endpoints.")
_SERVED_NAME = flags.DEFINE_string("served_model_name", None, "Model name of the API (default: --model).")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Most requests waiting for their first step; more get HTTP 429.")
_MAX_BYTES = flags.DEFINE_integer("max_request_bytes", None, "Largest request body; larger gets HTTP 413 "
                                  "(default: 1 MiB + 32 bytes per token of max_model_len).")
_GRACE = flags.DEFINE_float("shutdown_grace_s", 30.0, "On SIGTERM, how long requests in flight may finish "
                            "before they are aborted.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0's coordinator.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (0 serves HTTP).")

logger = logging.getLogger("mnemojax.serve")


def _engine_config():
    from mnemojax.engine import EngineConfig

    return EngineConfig(
        model=_MODEL.value, dtype=_DTYPE.value, tp=_TP.value, spp=_SPP.value, kvp=_KVP.value,
        max_tokens_per_kvp_rank=_MAX_PER_RANK.value, max_model_len=_MAX_MODEL_LEN.value,
        page_size=_PAGE_SIZE.value, num_pages=_NUM_PAGES.value, kv_memory_fraction=_KV_FRACTION.value,
        chunk_size=_CHUNK.value, max_num_batched_tokens=_BUDGET.value, max_num_seqs=_MAX_SEQS.value,
        scheduler_policy=_POLICY.value, target_batch_time_ms=_TARGET.value, hardware=_HARDWARE.value,
        seed=_SEED.value)


def _init_distributed() -> int:
    """Starts jax.distributed when the multi-host flags are given; returns the number of processes."""
    given = [f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)]
    if not any(given):
        return 1
    if not all(given):
        raise app.UsageError("multi-host needs all of --coordinator_address, --num_processes and --process_id")
    import jax

    jax.distributed.initialize(_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return _NUM_PROCESSES.value


class _Server:
    """uvicorn, with SIGTERM / SIGINT draining instead of cutting streams (and no re-raised signal at exit)."""

    def __init__(self, fastapi_app, llm, grace_s: float):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # runs in the main thread, which runs the event loop
                if outer.draining:  # a second signal: stop now
                    self.should_exit = True
                    self.force_exit = True
                    return
                outer.draining = True
                asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(outer.drain()))

        config = uvicorn.Config(fastapi_app, host=_HOST.value, port=_PORT.value, log_level="info",
                                timeout_graceful_shutdown=5)
        self.server = Server(config)
        self.app, self.llm, self.grace_s = fastapi_app, llm, grace_s
        self.draining = False

    async def drain(self) -> None:
        state = self.app.state.server
        state.draining = True
        logger.info("draining: no new requests; %d in flight get up to %.0f s", self.llm.num_active, self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while self.llm.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.llm.num_active:
            logger.info("aborting %d requests still in flight", self.llm.num_active)
            self.llm.abort_all()
            deadline = time.monotonic() + 5.0
            while self.llm.num_active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # let the last responses flush
        self.server.should_exit = True

    def run(self) -> None:
        self.server.run()


def main(argv):
    del argv
    num_processes = _init_distributed()
    from mnemojax.serving.app import build_app
    from mnemojax.async_llm import AsyncLLM
    from mnemojax.engine import LLMEngine

    config = _engine_config()
    engine = LLMEngine(config)
    leader = None
    if num_processes > 1:
        from mnemojax import multihost

        if _PROCESS_ID.value != 0:
            multihost.follow(engine.executor)
            return
        leader = multihost.Leader()
        engine.executor.channel = leader
    llm = AsyncLLM(engine=engine, idle_tick=None if leader is None else leader.noop)
    name = _SERVED_NAME.value or _MODEL.value
    max_bytes = _MAX_BYTES.value or (1 << 20) + 32 * engine.max_model_len
    fastapi_app = build_app(llm, served_model_name=name, api_key=_API_KEY.value, max_queue=_MAX_QUEUE.value,
                            max_request_bytes=max_bytes)
    logger.info("serving %r as %r on http://%s:%d (mesh kvp=%d spp=%d tp=%d, max_model_len %d)", config.model, name,
                _HOST.value, _PORT.value, config.kvp, config.spp, config.tp, engine.max_model_len)
    try:
        _Server(fastapi_app, llm, _GRACE.value).run()
    finally:
        llm.shutdown()
        if leader is not None:
            leader.stop()
    logger.info("stopped")


def run():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app.run(main)


if __name__ == "__main__":
    run()
