"""The HTTP server's own settings (the engine's are `EngineConfig`); `python -m mnemojax.serve` derives a flag
from each field, its help from the docstring under it."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 serves other machines)."""
    port: int = 8000
    """Port to listen on."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` on /v1 endpoints (/health and /metrics stay open)."""
    served_model_name: str | None = None
    """Model name of the API (default: --model)."""
    max_queue: int = 256
    """Most requests waiting for their first step; more get HTTP 429."""
    max_request_bytes: int | None = None
    """Largest request body; larger gets HTTP 413 (default: 1 MiB + 32 bytes per token of max_model_len)."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long requests in flight may finish before they are aborted."""

    def request_bytes_limit(self, max_model_len: int) -> int:
        return self.max_request_bytes or (1 << 20) + 32 * max_model_len


@dataclasses.dataclass(frozen=True)
class MultiHostConfig:
    """Multi-host serving: every process runs the same command with these three flags (see mnemojax.multihost)."""

    coordinator_address: str | None = None
    """Multi-host: host:port of process 0's coordinator."""
    num_processes: int | None = None
    """Multi-host: number of processes."""
    process_id: int | None = None
    """Multi-host: this process's index (0 serves HTTP)."""

    @property
    def enabled(self) -> bool:
        given = [v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise ValueError("multi-host needs all of coordinator_address, num_processes and process_id")
        return all(given)
