"""The HTTP server's own settings (the engine's are `EngineConfig`); `python -m mnemojax.serve` derives a flag
from each field, its help from the docstring under it."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping


API_KEY_ENV = "MNEMOJAX_API_KEY"
"""The environment variable holding the API key, when neither --api_key nor --api_key_file gives it."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 serves other machines)."""
    port: int = 8000
    """Port to listen on (0 to 65535; 0 lets the system pick a free one)."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` on /v1 endpoints (/health, /ping, /version and /metrics stay open). The
    process list shows it: prefer --api_key_file or the MNEMOJAX_API_KEY environment variable."""
    api_key_file: str | None = None
    """Read the API key from this file (its first line)."""
    served_model_name: str | None = None
    """Model name of the API (default: --model)."""
    max_queue: int = 256
    """Most requests waiting for their first step; more get HTTP 429."""
    max_choices: int = 256
    """Most choices one request may ask for (its prompts times n); more is HTTP 400. At most max_queue counts:
    a request with more choices could never be queued."""
    max_request_bytes: int | None = None
    """Largest request body; larger gets HTTP 413 (default: 1 MiB + 32 bytes per token of max_model_len)."""
    max_stop_strings: int = 16
    """Most stop strings one request may give; more is HTTP 400 (every token of every choice is checked
    against each)."""
    max_stop_chars: int = 1024
    """Most characters in all of a request's stop strings together; more is HTTP 400."""
    max_stop_token_ids: int = 64
    """Most stop token ids one request may give; more is HTTP 400."""
    header_timeout_s: float = 10.0
    """A connection must send a request's line and headers within this many seconds of opening (or of its
    previous response); else it is closed."""
    body_timeout_s: float = 30.0
    """A request's whole body must arrive within this many seconds of its headers; else HTTP 408."""
    write_timeout_s: float = 30.0
    """A client that takes none of a response for this many seconds (its socket buffers full) is disconnected,
    and its requests are aborted, freeing their KV pages."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long requests in flight may finish before they are aborted (a second signal: at once)."""
    chat_template: str | None = None
    """The chat template instead of the tokenizer's (vLLM's --chat-template): a file's path, or the Jinja template
    itself (text with a brace or a newline)."""
    trust_request_chat_template: bool = False
    """Let a request's `chat_template` replace the server's (vLLM's flag); without it such a request is a 400."""
    return_tokens_as_token_ids: bool = False
    """Logprobs write each token as 'token_id:<id>' unless a request says otherwise (vLLM's flag)."""
    response_role: str = "assistant"
    """The role of a chat reply when the request adds a generation prompt (vLLM's --response-role); without one,
    the reply takes the last message's role."""

    def __post_init__(self):
        for name in ("max_queue", "max_choices", "header_timeout_s", "body_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_stop_strings", "max_stop_chars", "max_stop_token_ids", "shutdown_grace_s"):
            if not getattr(self, name) >= 0:  # nan too: it compared as neither
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port!r}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1 (or unset for the default), got {self.max_request_bytes!r}")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give the API key by api_key or api_key_file, not both")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if not self.response_role:
            raise ValueError("response_role must not be empty")

    def resolved_chat_template(self) -> str | None:
        """The `chat_template` setting's template: a file's text, or the setting itself when it is a template
        (vLLM's rule: it has a brace or a newline); ValueError naming the field if it is neither."""
        value = self.chat_template
        if value is None:
            return None
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                return f.read()
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template (a template has a "
                         f"brace or a newline)")

    def request_bytes_limit(self, max_model_len: int) -> int:
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return (1 << 20) + 32 * max_model_len

    def with_api_key(self, environ: Mapping[str, str]) -> ServerConfig:
        """This config with `api_key` resolved: from `api_key`, else the first line of `api_key_file`, else the
        MNEMOJAX_API_KEY environment variable, else none."""
        key = self.api_key
        if self.api_key_file is not None:
            with open(self.api_key_file, encoding="utf-8") as f:
                key = f.readline().rstrip("\r\n")
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file!r} has an empty first line")
        elif key is None:
            key = environ.get(API_KEY_ENV) or None
        return dataclasses.replace(self, api_key=key, api_key_file=None)


@dataclasses.dataclass(frozen=True)
class MultiHostConfig:
    """Multi-host serving: every process runs the same command with these three flags (see mnemojax.engine.multihost)."""

    coordinator_address: str | None = None
    """Multi-host: host:port of process 0's coordinator."""
    num_processes: int | None = None
    """Multi-host: number of processes."""
    process_id: int | None = None
    """Multi-host: this process's index (0 serves HTTP)."""

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"process_id must be >= 0, got {self.process_id}")
        if None not in (self.process_id, self.num_processes) and self.process_id >= self.num_processes:
            raise ValueError(f"process_id must be < num_processes ({self.num_processes}), got {self.process_id}")
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"coordinator_address must be host:port with a port in 1..65535, got "
                                 f"{self.coordinator_address!r}")

    @property
    def enabled(self) -> bool:
        given = [v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise ValueError("multi-host needs all of coordinator_address, num_processes and process_id")
        return all(given)
