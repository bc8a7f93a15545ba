"""Multi-host serving on JAX's multi-controller runtime (`jax.distributed`).

Every process builds the same engine (same flags, hence the same mesh over all processes' devices, the same
parameters and KV cache shards). Process 0 owns the HTTP front end and the scheduler; each step it broadcasts
the step's host arrays (the executor's numpy view of the plan) and every process feeds them into the same
jitted step, so all run the same SPMD program. Followers never see requests, only arrays.

Page-table updates (the entries that changed since the previous step) go first when there are any: a header with
command TABLE and their count, then the [kvp, 2, U] updates (indices; pages); so do the penalties' state updates
(command PENALTY and their count, then the slots cleared [kvp, B + 1] and the entries [kvp, 4, U]). The step's
broadcast is two collectives: a fixed-size header (command, token rows T, logits rows R, whether results are fetched, the step's
kind), then its host arrays packed into one int32 buffer (`executor.Packing`), whose shape the header fixes. While idle, process 0 sends a no-op header
about once a second so the followers' pending collective never waits indefinitely.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from mnemojax.engine.executor import Packing
from models.kernels import MIXED, STEP_KINDS

logger = logging.getLogger(__name__)

STEP, NOOP, STOP, TABLE, PENALTY = 1, 2, 3, 4, 5


_PER_PROCESS = frozenset({"compilation_cache_dir", "save_predictor_profile"})
"""EngineConfig fields that may differ between processes (each host's own paths)."""


def check_same_config(config) -> None:
    """Raises ValueError naming the fields (and each process's value) where this process's `EngineConfig` differs
    from another's: every process must build the same engine, and one started with another seed or KV split would
    compute other numbers without an error, or block in a collective. A collective: every process calls it."""
    mine = {k: v for k, v in dataclasses.asdict(config).items() if k not in _PER_PROCESS}
    text = np.frombuffer(json.dumps(mine, sort_keys=True, default=str).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([len(text)], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(text)] = text
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    configs = [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths)]
    differ = sorted(k for k in configs[0] if any(c.get(k) != configs[0][k] for c in configs[1:]))
    if differ:
        values = "; ".join(f"{k}: " + ", ".join(f"process {i} {c.get(k)!r}" for i, c in enumerate(configs))
                           for k in differ)
        raise ValueError(f"the processes were started with different engine settings ({values}); start every "
                         f"process with the same flags")


def _broadcast(tree):
    """`tree` from process 0 to all, dtypes kept (the broadcast sums, so bools travel as int32)."""
    sent = jax.tree.map(lambda a: a.astype(np.int32) if a.dtype == np.bool_ else a, tree)
    got = multihost_utils.broadcast_one_to_all(sent)
    return jax.tree.map(lambda g, a: np.asarray(g).astype(a.dtype), got, tree)


class Leader:
    """Process 0's side: sends each step's arrays (plugged into `Executor.channel`)."""

    def step(self, T: int, R: int, packed: np.ndarray, fetch: bool, kind: str = MIXED, masked: bool = False) -> None:
        """A step of T token rows and R logits rows, its host arrays `packed` ([kvp, X] int32); `masked`: it has
        regex rows' masks (`Executor.host_template`)."""
        # the fetch flag, the step's kind and masked share the header's last field: fetch + 2 x kind index
        # + 64 x masked
        _broadcast(np.array([STEP, T, R, int(fetch) + 2 * STEP_KINDS.index(kind) + 64 * int(masked)], np.int32))
        _broadcast(packed)

    def table(self, updates: np.ndarray) -> None:
        """The page-table updates [kvp, 2, U] the executor applies before its next step."""
        _broadcast(np.array([TABLE, updates.shape[2], 0, 0], np.int32))
        _broadcast(updates)

    def penalties(self, clear: np.ndarray, entries: np.ndarray) -> None:
        """The penalties' state updates (slots cleared [kvp, B + 1], entries [kvp, 4, U]) applied before the next
        step."""
        _broadcast(np.array([PENALTY, entries.shape[2], 0, 0], np.int32))
        _broadcast((clear, entries))

    def noop(self) -> None:
        _broadcast(np.array([NOOP, 0, 0, 0], np.int32))

    def stop(self) -> None:
        _broadcast(np.array([STOP, 0, 0, 0], np.int32))


def follow(executor) -> int:
    """A follower's loop: runs every step process 0 broadcasts until it says stop. Returns the steps run."""
    steps = 0
    logger.info("process %d follows process 0's steps", jax.process_index())
    while True:
        cmd, T, R, fetch = (int(x) for x in _broadcast(np.zeros(4, np.int32)))
        if cmd == STOP:
            logger.info("process %d: stop after %d steps", jax.process_index(), steps)
            return steps
        if cmd == NOOP:
            continue
        if cmd == TABLE:
            U = T
            executor.apply_table_updates(_broadcast(np.zeros((executor.kvp, 2, U), np.int32)), broadcast=False)
            continue
        if cmd == PENALTY:
            executor.apply_penalty_updates(*_broadcast(executor._no_penalty_updates(T)), broadcast=False)
            continue
        if cmd != STEP:
            raise RuntimeError(f"unknown multi-host command {cmd}")
        template, packing = Packing.pack(executor.host_template(T, R, bool(fetch >> 6)))
        executor.run(executor.put(T, (_broadcast(template), packing)), fetch=bool(fetch & 1),
                     kind=STEP_KINDS[(fetch >> 1) & 31])
        steps += 1
