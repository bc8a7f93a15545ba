"""Bytes moved by the collectives of one compiled engine step, per mesh axis, against the Medha formulas.

    python scripts/hlo_comm.py [--lens 512,8192] [--meshes 2,1,1/4,1,1/1,2,1/1,4,1/1,1,2/1,1,4/2,2,2]

For each (kvp, spp, tp) mesh and each max_model_len it builds a `mnemojax.LLM` engine on the `tiny` preset,
drives its scheduler (no step is run) with one request whose prompt fills the context to max_model_len - 16
tokens, and takes two plans: the last prefill chunk (deepest into the context) and the decode step after it.
KV parallelism splits the request over all KVP ranks (`max_tokens_per_kvp_rank = max_model_len / kvp`), so
the decode is a shared row on every rank. Each plan's step is lowered with `Executor.lower` and compiled (not
run); the optimized HLO is parsed for collectives: operand bytes per device, the mesh axes their
replica_groups / source_target_pairs span, and how many times they run per step (the product of the known
trip counts of the while loops around them; the layers are unrolled, so each layer's collectives appear once).

Bytes are the payload each device puts into the collective per step (operand bytes x executions), not the
wire traffic of a particular algorithm (a ring all-reduce of n devices sends 2 (n-1)/n of it). Medha's
formulas, per device per step, for T query rows, Ls layers per stage, N/tp local heads of H dims, D hidden:
  KVP merge   Ls x T x (N/tp) x (H + 2) x 4 B  (partial outputs and the softmax max / denominator, f32)
  SPP         T x D x b                         (one activation block per stage boundary)
  TP          2 x Ls x T x D x b                (all-reduce after attention and after the MLP)
The parsing helpers (`parse_hlo`, `find_collectives`, `bytes_by_axis`) are reused by tests/shardings/test_hlo_comm.py.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import platform
import re
import shlex
import sys
import time



import numpy as np  # noqa: E402

KINDS = ("all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


# ------------------------------------------------------------------------------------------------ HLO text
@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    shape: str  # result shape text, e.g. "f32[16,4]{1,0}" or "(f32[2]{0}, s32[])"
    opcode: str
    operands: tuple[str, ...]  # operand instruction names
    attrs: str  # everything after the operand list


@dataclasses.dataclass(frozen=True)
class Module:
    computations: dict[str, list[Instr]]
    entry: str

    @property
    def shapes(self) -> dict[str, str]:
        return {i.name: i.shape for instrs in self.computations.values() for i in instrs}


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise ValueError(f"unbalanced brackets in HLO line: {s[:200]}")


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def parse_hlo(text: str) -> Module:
    """Splits HLO module text (as `Compiled.as_text()` prints it) into computations of instructions."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        rest = line[m.end():]
        if rest.startswith("("):  # tuple shape
            end = _balanced(rest, 0)
        else:
            end = rest.index(" ")
        shape, rest = rest[:end], rest[end:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        close = _balanced(rest, op.end() - 1)
        args = rest[op.end():close - 1]
        comps[current].append(Instr(m.group(1), shape, op.group(1),
                                    tuple(re.findall(r"%([\w.\-]+)", args)), rest[close:]))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)


def shape_bytes(shape: str) -> int:
    """Bytes of an array or tuple shape text (layouts and /*index*/ comments ignored)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue  # token[], opaque
        total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _callees(instr: Instr) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction calls."""
    out = re.findall(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)",
                     instr.attrs)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", instr.attrs):
        out += [("branch", c) for c in re.findall(r"%?([\w.\-]+)", group)]
    return out


def trip_count(instr: Instr) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', instr.attrs)
    return int(m.group(1)) if m else None


def multiplicities(module: Module) -> dict[str, tuple[int | None, int]]:
    """Per computation: (executions per run of the entry, None if a surrounding loop has no known trip
    count; number of while bodies around it). A computation called from several places sums them."""
    out: dict[str, tuple[int | None, int]] = {}

    def visit(comp: str, mult: int | None, depth: int):
        old = out.get(comp)
        if old is None:
            out[comp] = (mult, depth)
        else:
            out[comp] = (None if old[0] is None or mult is None else old[0] + mult, max(old[1], depth))
        for instr in module.computations.get(comp, []):
            for attr, callee in _callees(instr):
                if instr.opcode == "while" and attr == "body":
                    n = trip_count(instr)
                    visit(callee, None if n is None or mult is None else mult * n, depth + 1)
                elif attr in ("to_apply", "condition") and instr.opcode != "call":
                    continue  # reductions / loop conditions: no collectives
                else:
                    visit(callee, mult, depth)

    visit(module.entry, 1, 0)
    return out


_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"


def _iota(m: re.Match) -> np.ndarray:
    """The ids of an iota list `[shape]<=[dims]T(perm)` (groups 1-3 of `m`), shaped `shape`."""
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape([int(x) for x in m.group(1).split(",")])


def _mesh_groups(m: re.Match) -> list[list[int]]:
    """The groups of a mesh-axes replica group list (XLA's `MeshAxesReplicaGroupList`, what jax 0.11's compiled
    HLO prints): `mesh['a'=2,'b'=4](devices) {'b'}`, one group per index of the axes not listed, its devices along
    the listed ones; `(devices)`: the ids in mesh order (iota when absent); a sub-axis `'b':(pre)size` is the middle
    part of b split major to minor into pre x size x the rest (Shardy's convention)."""
    axes = [(n, int(k)) for n, k in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    if m.group(2):
        iota = re.fullmatch(_IOTA, m.group(2))
        ids = _iota(iota) if iota else np.array([int(x) for x in re.findall(r"\d+", m.group(2))])
    else:
        ids = np.arange(int(np.prod([k for _, k in axes])))
    shape, grouped = [], []  # each axis as (pre, size, post) dims; the grouped ones' middle dims
    subs = {n: (int(pre), int(size)) for n, pre, size in re.findall(r"'([^']+)':\((\d+)\)(\d+)", m.group(3))}
    listed = re.findall(r"'([^']+)'", m.group(3))
    for n, k in axes:
        pre, size = subs.get(n, (1, k))
        if n in listed:
            grouped.append(len(shape) + 1)
        shape += [pre, size, k // (pre * size)]
    ids = ids.reshape(shape)
    rest = [d for d in range(len(shape)) if d not in grouped]
    n_group = int(np.prod([shape[d] for d in grouped])) if grouped else 1
    return ids.transpose(rest + grouped).reshape(-1, n_group).tolist()


def replica_groups(attrs: str) -> list[list[int]] | None:
    """The device groups of a collective: explicit {{..},{..}}, iota [G,S]<=[dims]T(perm), mesh axes
    mesh[..] {..} (jax 0.11), or pairs."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([\d,]+)", m.group(1) + "}")]
    m = re.search(r"replica_groups=" + _IOTA, attrs)
    if m:
        return _iota(m).tolist()
    m = re.search(r"replica_groups=@?mesh[\[<]([^\]>]*)[\]>](?:\((.*?)\))?\s*\{([^}]*)\}", attrs)
    if m:
        return _mesh_groups(m)
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return [g for g in groups if g] or None  # {} = every device in one group
    return None


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    name: str  # HLO instruction name
    shapes: tuple[str, ...]  # operand shapes (dtype[dims])
    bytes: int  # operand bytes per device, one execution
    axes: tuple[str, ...]  # mesh axes (of size > 1) its groups span; () when all groups are single devices
    group_size: int
    count: int | None  # executions per step; None: inside a loop of unknown trip count
    loop_depth: int  # while bodies around it (the layers are unrolled: 0 for theirs)
    op_name: str  # jax op it came from (metadata)

    @property
    def step_bytes(self) -> int:
        return self.bytes * (self.count if self.count is not None else 1)

    @property
    def axis(self) -> str:
        """The mesh axes it spans joined by "+", or "1-device" when every group is a single device (a
        collective over a size-1 axis that XLA kept: no traffic)."""
        return "+".join(self.axes) or "1-device"


def device_coords(mesh, devices=None) -> np.ndarray:
    """Mesh coordinates [n, 3] of each logical device id of the compiled program.

    `devices`: the executable's devices in logical-id order (default: the mesh's own flat order, which is
    the device assignment `jit` uses for a program over `mesh`)."""
    pos = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
    devices = list(mesh.devices.flat) if devices is None else list(devices)
    return np.array([pos[d.id] for d in devices])


def find_collectives(text: str, mesh, devices=None) -> list[Collective]:
    """Every collective of a compiled HLO module, with its per-device bytes and the mesh axes it spans."""
    module = parse_hlo(text)
    shapes = module.shapes
    mult = multiplicities(module)
    coords = device_coords(mesh, devices)
    names = mesh.axis_names
    found = []
    for comp, instrs in module.computations.items():
        if comp not in mult:
            continue  # not reachable from the entry
        count, depth = mult[comp]
        for instr in instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            op_shapes = tuple(shapes.get(o, "") for o in instr.operands)
            nbytes = sum(shape_bytes(s) for s in op_shapes)
            if not instr.operands:  # operands printed without names: fall back to the result shape
                nbytes = shape_bytes(instr.shape)
            groups = replica_groups(instr.attrs)
            if groups is None:
                groups = [list(range(len(coords)))]
            varying = set()
            for g in groups:
                c = coords[g]
                varying |= {names[a] for a in range(c.shape[1]) if len(set(c[:, a])) > 1}
            op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
            found.append(Collective(
                kind, instr.name, tuple(re.sub(r"\{[\d,]*\}", "", s) for s in op_shapes), nbytes,
                tuple(a for a in names if a in varying), max(len(g) for g in groups), count, depth,
                op_name.group(1) if op_name else ""))
    return found


def bytes_by_axis(colls: list[Collective]) -> dict[str, int]:
    out: dict[str, int] = collections.Counter()
    for c in colls:
        out[c.axis] += c.step_bytes
    return dict(out)


def axis_multiset(colls: list[Collective], axis: str) -> collections.Counter:
    """(kind, operand shapes, bytes per step) of the collectives over exactly `axis`."""
    return collections.Counter((c.kind, c.shapes, c.step_bytes) for c in colls if c.axis == axis)


# ------------------------------------------------------------------------------------------------ engines
def make_engine(kvp: int, spp: int, tp: int, max_model_len: int, *, page_size: int = 16, chunk_size: int = 256,
                model: str = "tiny"):
    """An LLM whose long request spreads over every KVP rank, with just enough pages for it."""
    from mnemojax import LLM
    per_rank = -(-max_model_len // kvp)
    return LLM(model=model, kvp=kvp, spp=spp, tp=tp, max_model_len=max_model_len, page_size=page_size,
               chunk_size=chunk_size, max_num_batched_tokens=chunk_size, max_num_seqs=4,
               num_pages=-(-per_rank // page_size) + 2,
               max_tokens_per_kvp_rank=None if kvp == 1 else -(-per_rank // page_size) * page_size)


def step_plans(llm, context: int | None = None) -> dict:
    """{"prefill": the last prefill chunk, "decode": the decode step after it} of one request whose prompt is
    `context` tokens (default max_model_len - 16), driving the scheduler only (nothing runs)."""
    from mnemojax import SamplingParams
    engine = llm.engine
    context = context or engine.max_model_len - 16
    rng = np.random.default_rng(context)
    rid = engine.add_request(rng.integers(0, 256, context).tolist(), SamplingParams(max_tokens=2))
    req = engine.requests[rid]
    prefill = None
    while req.num_computed < req.num_tokens:
        prefill = engine.scheduler.schedule()
    # Pretend the step ran and sampled a token: the next plan is the decode.
    req.output_token_ids.append(1)
    req.awaiting_sample, req.in_flight = False, 0
    decode = engine.scheduler.schedule()
    assert [c.num_tokens for c in decode.chunks] == [1], decode
    return {"prefill": prefill, "decode": decode}


@dataclasses.dataclass(frozen=True)
class StepComm:
    """The collectives of one compiled step and the row counts of its arrays."""

    T: int  # token rows of each (rank, stage)'s micro-batch
    R: int  # logits rows of each rank
    collectives: list[Collective]


_compiled: dict[tuple, tuple[str, list | None]] = {}  # lowered program text -> (optimized HLO, devices)


def step_comm(llm, plan) -> StepComm:
    """Lowers the engine's step for `plan` (state unchanged), compiles it (not run) and reads its collectives.

    Identical programs (with spp > 1 a decode and a prefill chunk share the token rows) compile once."""
    lowered = llm.engine.executor.lower(plan)
    T, R = llm.engine.executor.step_rows(plan)
    mesh = llm.engine.mesh
    key = (tuple(mesh.devices.shape), lowered.as_text())
    if key not in _compiled:
        compiled = lowered.compile()
        try:
            devices = compiled.runtime_executable().local_devices()  # in logical-id order
        except Exception:  # noqa: BLE001 - a runtime without it: the mesh order is jit's device assignment
            devices = None
        _compiled[key] = compiled.as_text(), devices
    text, devices = _compiled[key]
    return StepComm(T, R, find_collectives(text, mesh, devices))


def medha_bytes(llm, T: int) -> dict[str, int]:
    """Per device per step: Medha's communication volume of each axis for T query rows."""
    import jax.numpy as jnp
    e = llm.engine
    c, ex = e.model_config, e.executor
    kvp, spp, tp = ex.kvp, ex.spp, ex.tp
    layers = len(ex.params["layers"])  # per stage (padded layout)
    heads = ex.params["layers"][0]["wq"].shape[2] // tp
    b = jnp.dtype(e.config.dtype).itemsize
    return {"kvp": layers * T * heads * (c.head_dim + 2) * 4 if kvp > 1 else 0,
            "spp": T * c.hidden_size * b if spp > 1 else 0,
            "tp": 2 * layers * T * c.hidden_size * b if tp > 1 else 0}


# ------------------------------------------------------------------------------------------------ main
def _fmt(n: int | None) -> str:
    return "-" if not n else f"{n:,}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="512,8192", help="max_model_len values, comma-separated")
    ap.add_argument("--meshes", default="2,1,1/4,1,1/1,2,1/1,4,1/1,1,2/1,1,4/2,2,2",
                    help="kvp,spp,tp meshes, separated by /")
    ap.add_argument("--chunk_size", type=int, default=256)
    ap.add_argument("--details", default="2,2,2", help="mesh whose collectives are listed one by one")
    args = ap.parse_args(argv)
    import jax
    import jaxlib

    lens = [int(x) for x in args.lens.split(",")]
    meshes = [tuple(int(x) for x in m.split(",")) for m in args.meshes.split("/")]
    details = tuple(int(x) for x in args.details.split(",")) if args.details else None
    print("command:", shlex.join([sys.executable, *sys.argv]))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"hardware: {cpu}, {os.cpu_count()} cores; jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"backend {jax.default_backend()}, {jax.device_count()} devices ({jax.devices()[0].device_kind})")
    from models.config import preset
    c = preset("tiny")
    print(f"model: tiny (L={c.num_layers}, D={c.hidden_size}, N={c.num_heads}, K={c.num_kv_heads}, "
          f"H={c.head_dim}, F={c.intermediate_size}, V={c.vocab_size}), float32, page_size 16, "
          f"chunk_size = token budget = {args.chunk_size}")
    t0 = time.perf_counter()
    rows = []
    surprises = []
    for kvp, spp, tp in meshes:
        by_len = {}
        for n in lens:
            llm = make_engine(kvp, spp, tp, n, chunk_size=args.chunk_size)
            M = llm.engine.executor.max_pages_per_seq
            for kind, plan in step_plans(llm).items():
                comm = step_comm(llm, plan)
                colls, T, R = comm.collectives, comm.T, comm.R
                ctx = plan.chunks[0].start + plan.chunks[0].num_tokens
                by_len[(n, kind)] = colls
                measured = bytes_by_axis(colls)
                formula = medha_bytes(llm, T)
                unknown = [x for x in colls if x.count is None]
                if unknown:
                    surprises.append(f"({kvp},{spp},{tp}) {kind} @ {n}: {len(unknown)} collective(s) in a loop "
                                     f"of unknown trip count: {[x.name for x in unknown]}")
                other = sum(v for a, v in measured.items() if a not in ("kvp", "spp", "tp", "1-device"))
                rows.append((f"({kvp},{spp},{tp})", kind, n, M, ctx, T, R,
                             measured.get("kvp", 0), formula["kvp"], measured.get("spp", 0), formula["spp"],
                             measured.get("tp", 0), formula["tp"], other, measured.get("1-device", 0)))
                if details == (kvp, spp, tp) and n == lens[-1]:
                    print(f"\ncollectives of the {kind} step on mesh ({kvp},{spp},{tp}), max_model_len {n} "
                          f"(T={T}, R={R}):")
                    for x in colls:
                        print(f"  {x.kind:<18} axis {x.axis:<8} group {x.group_size}  "
                              f"{' + '.join(x.shapes):<34} {x.bytes:>9,} B x {x.count} = {x.step_bytes:>10,} B  "
                              f"loop depth {x.loop_depth}  [{x.op_name.split('/')[-1]}]")
        for kind in ("decode", "prefill"):
            sets = [axis_multiset(by_len[(n, kind)], "kvp") for n in lens]
            if any(s != sets[0] for s in sets):
                surprises.append(f"({kvp},{spp},{tp}) {kind}: kvp collectives differ between max_model_len "
                                 f"{lens}: {sets}")
    print(f"\n{len(rows)} steps lowered and compiled in {time.perf_counter() - t0:.0f} s "
          f"({len(_compiled)} distinct programs)")
    print("checks:", "; ".join(surprises) if surprises else
          "KVP collectives identical across max_model_len for every mesh and step; every loop trip count known")
    print("\nBytes per device per step (operand payload x executions); in parentheses Medha's formula:\n"
          "  kvp: Ls*T*(N/tp)*(H+2)*4   spp: T*D*b   tp: 2*Ls*T*D*b   (Ls layers per stage, b dtype bytes)\n"
          "  ctx: tokens in the context after the step; M: page-table width; T, R: token and logits rows\n"
          "  1-device: collectives over a size-1 axis (replica groups of one device) left in the program")
    head = ("mesh kvp,spp,tp", "step", "max_len", "M", "ctx", "T", "R", "kvp bytes (Medha)", "spp bytes (Medha)",
            "tp bytes (Medha)", "other axes", "1-device (no traffic)")
    table = [head] + [(r[0], r[1], str(r[2]), str(r[3]), str(r[4]), str(r[5]), str(r[6]),
                       f"{_fmt(r[7])} ({_fmt(r[8])})", f"{_fmt(r[9])} ({_fmt(r[10])})",
                       f"{_fmt(r[11])} ({_fmt(r[12])})", _fmt(r[13]), _fmt(r[14])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("| " + " | ".join(cell.rjust(w) if j >= 2 else cell.ljust(w)
                                for j, (cell, w) in enumerate(zip(row, widths))) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
