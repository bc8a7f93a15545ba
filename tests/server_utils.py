"""Helpers for the server tests: a live uvicorn server in a thread, `python -m mnemojax.serve` subprocesses,
and reading /metrics."""
from __future__ import annotations

import dataclasses
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range and not handed out before in this process.
    A port from `bind(0)` lies inside that range, so while a server starts (a minute, in the multi-process test)
    the kernel may give the same port to any outgoing connection (a gRPC client of the JAX coordinator, say)
    and the server's bind then fails (uvicorn exits with 3: seen once in CI)."""
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    for port in candidates:
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


class ThreadServer:
    """An app of `build_app` served by uvicorn on a free loopback port, in a background thread, set up as
    `python -m mnemojax.serve` sets it up (the connection timeouts of the app's config)."""

    def __init__(self, app):
        import uvicorn

        from mnemojax.serving.http import uvicorn_config

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = dataclasses.replace(app.state.server.config, host="127.0.0.1", port=self.port)
        # log_config=None: uvicorn's default logging.config.dictConfig would close pytest's log-capture handlers
        self.server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_env(num_cpu_devices: int) -> dict:
    """The environment of a server subprocess with `num_cpu_devices` CPU devices (no fake-device flag)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_NUM_CPU_DEVICES"] = str(num_cpu_devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_serve(flags: list[str], num_cpu_devices: int = 1, log=None, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mnemojax.serve", *flags],
                            env={**serve_env(num_cpu_devices), **(env or {})}, cwd=ROOT,
                            stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)


class ServeProcess:
    """`python -m mnemojax.serve` on a free loopback port, as a `with` block: healthy on entry, killed on exit if
    still running; `output` holds its log after the block. `env` adds environment variables."""

    def __init__(self, flags: list[str], num_cpu_devices: int = 1, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = (["--port", str(self.port), *flags], num_cpu_devices)
        self._env = env
        self.output = ""

    def __enter__(self) -> ServeProcess:
        self._log = tempfile.TemporaryFile()
        self.proc = start_serve(*self._args, log=self._log, env=self._env)
        try:
            wait_healthy(self.url, [self.proc])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.seek(0)
        self.output = self._log.read().decode(errors="replace")
        self._log.close()


def wait_healthy(url: str, procs=(), timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"server process exited with {p.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def metrics(url: str) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what} not reached within {timeout} s")
