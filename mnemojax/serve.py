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

from mnemojax.cli import define_flags, from_flags
from mnemojax.serving.config import MultiHostConfig, ServerConfig

logger = logging.getLogger("mnemojax.serve")
FLAGS = flags.FLAGS


def _init_distributed(mh: MultiHostConfig) -> int:
    """Starts jax.distributed when the multi-host flags are given; returns the number of processes."""
    try:
        if not mh.enabled:
            return 1
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    import jax

    jax.distributed.initialize(mh.coordinator_address, num_processes=mh.num_processes, process_id=mh.process_id)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return mh.num_processes


class _Server:
    """uvicorn, with SIGTERM / SIGINT draining instead of cutting streams (and no re-raised signal at exit)."""

    def __init__(self, fastapi_app, llm, host: str, port: int, grace_s: float):
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

        config = uvicorn.Config(fastapi_app, host=host, port=port, log_level="info",
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
    from mnemojax.engine import EngineConfig

    config, server, mh = from_flags(EngineConfig), from_flags(ServerConfig), from_flags(MultiHostConfig)
    num_processes = _init_distributed(mh)
    from mnemojax.async_llm import AsyncLLM
    from mnemojax.engine import LLMEngine
    from mnemojax.serving.app import build_app

    leader = None
    if num_processes > 1:
        from mnemojax import multihost

        if mh.process_id != 0:
            multihost.follow(LLMEngine(config).executor)
            return
        leader = multihost.Leader()
    engine = LLMEngine(config, channel=leader)
    llm = AsyncLLM(engine=engine, idle_tick=None if leader is None else leader.noop)
    name = server.served_model_name or config.model
    fastapi_app = build_app(llm, served_model_name=name, api_key=server.api_key, max_queue=server.max_queue,
                            max_request_bytes=server.request_bytes_limit(engine.max_model_len))
    logger.info("serving %r as %r on http://%s:%d (mesh kvp=%d spp=%d tp=%d, max_model_len %d)", config.model, name,
                server.host, server.port, config.kvp, config.spp, config.tp, engine.max_model_len)
    try:
        _Server(fastapi_app, llm, server.host, server.port, server.shutdown_grace_s).run()
    finally:
        llm.shutdown()
        if leader is not None:
            leader.stop()
    logger.info("stopped")


def define_serve_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """The command's flags: every EngineConfig, ServerConfig and MultiHostConfig field."""
    from mnemojax.engine import EngineConfig

    for cls in (EngineConfig, ServerConfig, MultiHostConfig):
        define_flags(cls, flag_values)


def run():
    define_serve_flags()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app.run(main)


if __name__ == "__main__":
    run()
