"""`python -m mnemojax.serve`: the OpenAI-compatible HTTP server.

    python -m mnemojax.serve --model tiny --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'

Multi-host: start the same command on every process with `--coordinator_address host:port --num_processes N
--process_id i`; process 0 serves HTTP and schedules, the others run its steps (see `mnemojax.engine.multihost`).

SIGTERM (or Ctrl-C) drains: new requests get 503, requests in flight may finish for `--shutdown_grace_s`, then
the rest are aborted with a final message (finish_reason "abort"), and the process exits 0. A second signal ends
the grace at once (the same final messages); a third stops without them.

The API key is best given by `--api_key_file` or the MNEMOJAX_API_KEY environment variable: `--api_key` shows it
in the process list.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from absl import flags

from mnemojax.cli import define_flags, from_flags, no_arguments, run_command, usage_errors
from mnemojax.serving.config import MultiHostConfig, ServerConfig
from models.tokenizer import has_hf_tokenizer

logger = logging.getLogger("mnemojax.serve")
FLAGS = flags.FLAGS


def _init_distributed(mh: MultiHostConfig) -> int:
    """Starts jax.distributed when the multi-host flags are given; returns the number of processes."""
    with usage_errors():
        if not mh.enabled:
            return 1
    import jax

    jax.distributed.initialize(mh.coordinator_address, num_processes=mh.num_processes, process_id=mh.process_id)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return mh.num_processes


class _Server:
    """uvicorn with the connection timeouts (`mnemojax.serving.http`), and signals that drain instead of cutting
    streams: the first SIGTERM / SIGINT drains with a grace period, the second ends the grace (abort now, final
    chunks still sent), a third exits at once. No signal is re-raised at exit."""

    def __init__(self, fastapi_app, llm, config: ServerConfig):
        import uvicorn

        from mnemojax.serving.http import uvicorn_config

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # runs in the main thread, which runs the event loop
                outer.signals += 1
                loop = asyncio.get_event_loop()
                if outer.signals == 1:
                    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(outer.drain()))
                elif outer.signals == 2:
                    loop.call_soon_threadsafe(outer.hurry.set)
                else:
                    self.should_exit = self.force_exit = True

        self.server = Server(uvicorn_config(fastapi_app, config, log_level="info", timeout_graceful_shutdown=5))
        self.app, self.llm, self.grace_s = fastapi_app, llm, config.shutdown_grace_s
        self.signals = 0
        self.hurry = asyncio.Event()  # a second signal: the grace is over

    async def _wait_for_requests(self, seconds: float) -> None:
        """Until no request is in flight, `seconds` pass, or (the grace only) a second signal comes."""
        deadline = time.monotonic() + seconds
        while self._busy() and time.monotonic() < deadline and not self.hurry.is_set():
            await asyncio.sleep(0.05)

    def _busy(self) -> bool:
        """Requests in flight, admitted ones not started yet, or beam searches (between their steps no request
        runs)."""
        state = self.app.state.server
        return bool(self.llm.num_active or state.num_admitted or state.num_searches)

    async def drain(self) -> None:
        state = self.app.state.server
        state.start_draining()
        logger.info("draining: no new requests; %d in flight and %d beam searches get up to %.0f s (a second signal "
                    "aborts them now)", self.llm.num_active, state.num_searches, self.grace_s)
        await self._wait_for_requests(self.grace_s)
        if self._busy():
            logger.info("aborting %d requests and %d beam searches still in flight", self.llm.num_active,
                        state.num_searches)
            state.aborting = True  # a beam search between its steps takes no more
            self.llm.abort_all()
            self.hurry.clear()
            await self._wait_for_requests(5.0)
        await asyncio.sleep(0.1)  # let the last responses flush
        self.server.should_exit = True

    def run(self) -> None:
        self.server.run()


def _freeze_startup() -> None:
    from mnemojax.engine.llm_engine import freeze_startup_objects

    logger.info("froze %d objects of start-up out of the garbage collector's reach (gc.freeze)",
                freeze_startup_objects())


def main(argv):
    no_arguments(argv)
    from mnemojax.engine.llm_engine import EngineConfig

    with usage_errors():
        config, mh = from_flags(EngineConfig), from_flags(MultiHostConfig)
        server = from_flags(ServerConfig).with_api_key(os.environ)
        if server.resolved_chat_template() is not None and not has_hf_tokenizer(config.model):
            # before the model loads (the app checks it again, for the library's callers)
            raise ValueError(f"chat_template: model {config.model!r} has no Hugging Face tokenizer, whose chat "
                             f"template it would replace (a preset has none, or the tiny model's fixed one; a "
                             f"checkpoint directory needs its tokenizer files)")
    num_processes = _init_distributed(mh)
    from mnemojax.engine.async_llm import AsyncLLM
    from mnemojax.engine.llm_engine import LLMEngine
    from mnemojax.serving.app import build_app

    leader = None
    if num_processes > 1:
        from mnemojax.engine import multihost

        with usage_errors():  # every process, before building anything: the same settings everywhere
            multihost.check_same_config(config)
        if mh.process_id != 0:
            with usage_errors():  # a setting only the model or the devices can refuse (the KV split, say)
                follower = LLMEngine(config).executor
            _freeze_startup()
            multihost.follow(follower)
            return
        leader = multihost.Leader()
    with usage_errors():
        engine = LLMEngine(config, channel=leader)
    llm = AsyncLLM(engine=engine, idle_tick=None if leader is None else leader.noop)
    with usage_errors():  # a --chat_template the model's tokenizer cannot take
        fastapi_app = build_app(llm, server)
    _freeze_startup()
    logger.info("serving %r as %r on http://%s:%d (mesh kvp=%d spp=%d tp=%d, max_model_len %d%s)", config.model,
                fastapi_app.state.server.served_model_name, server.host, server.port, config.kvp, config.spp,
                config.tp, engine.max_model_len, ", API key required" if server.api_key else "")
    try:
        _Server(fastapi_app, llm, server).run()
    finally:
        llm.shutdown()
        if leader is not None:
            leader.stop()
    logger.info("stopped")


SERVE_DEFAULTS = {"scheduler_policy": "ilrs", "target_batch_time_ms": 50.0}
"""The server's scheduling defaults, where they differ from EngineConfig's (the library keeps fcfs, no target):
ILRS with a calibrated 50 ms target served the serving benchmark's long + short mix best (docs/benchmarks.md,
2026-11-23). `--target_batch_time_ms=none` turns adaptive chunking off."""


def define_serve_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """The command's flags: every EngineConfig, ServerConfig and MultiHostConfig field."""
    from mnemojax.engine.llm_engine import EngineConfig

    for cls in (EngineConfig, ServerConfig, MultiHostConfig):
        define_flags(cls, flag_values, defaults=SERVE_DEFAULTS if cls is EngineConfig else None)


def run():
    define_serve_flags()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_command(main)


if __name__ == "__main__":
    run()
