"""Compile the engine's step for a GPU this machine may lack, and count what it launches.

XLA compiles for an NVIDIA GPU without one ("deviceless" compilation): jax's CUDA plugin makes a topology of
compile-only devices from a description of the GPU (`TARGETS`), and a step lowered over a mesh of them
(`Executor.lower_shape`) compiles as it would on that GPU: the same HLO passes and fusions, every kernel compiled
to sm_90 code (the Pallas Triton attention kernels included: the serialized executable holds their PTX and
cubins). What differs: nothing is autotuned (XLA picks gemm tilings by its
heuristics where a GPU would time candidates), and the Mosaic GPU kernels stay opaque custom calls (Mosaic
compiles them to PTX when the executable first runs). The parameters are abstract (`jax.ShapeDtypeStruct`s), so
a 70B model's step compiles on a laptop; the executor's small arrays (KV cache of a few pages, page table) are
made on this machine's CPU. Needs the CUDA plugin of this jax, not a GPU:

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"   # ~5.5 GB with CUDA's libraries
    python scripts/aot_step.py --model llama3-8b --batch 1
    python scripts/aot_step.py --model llama3.2-1b --batch 32 --attention pallas,mosaic,reference

For each step kind (decode, prefill, mixed) it prints what the optimized HLO launches per step, counted
statically (`count_launches`): kernels (fusions, gemms, attention kernels, copies, collectives), per layer (ops
carry their layer's name, `layer_i`, `models.llama.LAYER_SCOPE`), outside the layers, the weight copies
(`weight_copies`: arrays of a layer weight's shape made out of stored arrays alone, as a layer loop that slices
stacked weights makes each step), and the step's scratch memory on the device (XLA's memory analysis). It is the
compiler's plan, not a trace: `scripts/profile_step.py` on a GPU counts what actually ran (cuBLAS may launch more
than one kernel per gemm; a while loop's trip count is known here only when XLA knows it). Checked against the
one GPU trace on record in docs/benchmarks.md (2026-11-26). `--target local` compiles for this machine's own
devices instead (no plugin needed).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections import Counter

# A description of each GPU for XLA's deviceless compilation (xla/stream_executor's GpuTargetConfigProto): the
# H100 SXM's properties as its CUDA device query reports them (as in jax issue 28376's example); the H200 the
# same chip (132 SMs, the same SMEM and registers) with its data sheet's memory (141 GB) and bandwidth (4.8 TB/s).
# They steer XLA's cost model, not correctness. runtime_version: the CUDA of jax's cuda12 plugin.
_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
runtime_version {{
  major: 12
  minor: 9
}}
device_description_str: "{name}"
"""
TARGETS = {
    "h100": _TARGET.format(name="NVIDIA H100 80GB HBM3", bandwidth=3352320000000, memory=84929347584),
    "h200": _TARGET.format(name="NVIDIA H200", bandwidth=4800000000000, memory=141000000000),
}

# --------------------------------------------------------------------------------------- reading optimized HLO
# Instructions that launch nothing: views, tuples, parameters, constants, and the ends of async pairs.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
         "add-dependency", "domain"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
_GEMM_KINDS = ('"kind":"__triton_gemm"', '"kind":"__triton_nested_gemm_fusion"', '"kind":"__cublas')
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")


@dataclasses.dataclass
class Instruction:
    name: str
    type: str  # its result's: "bf16[4096,32,128]{2,1,0}", or a tuple "(f32[8], s32[])"
    opcode: str
    operands: list[str]  # the names of the instructions it reads
    text: str  # the whole line

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%([\w.\-]+)", self.text)
        return m.group(1) if m else None

    def called(self, key: str) -> list[str]:
        m = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.text)
        return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []

    def runs(self) -> list[str]:
        """The computations this instruction runs as launches of their own: a while loop's condition and body, a
        conditional's branches, a call's computation (not a fusion's, which is one kernel)."""
        if self.opcode == "while":
            return [self.attr("condition"), self.attr("body")]
        if self.opcode == "conditional":
            return self.called("branch_computations") or [self.attr("true_computation"),
                                                          self.attr("false_computation")]
        return [self.attr("to_apply")] if self.opcode == "call" else []


def _closing(line: str, i: int) -> int:
    """The index just past the parenthesis that closes the one at `line[i]`."""
    depth = 0
    while True:
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        i += 1
        if depth == 0:
            return i


def _instruction(name: str, line: str, start: int) -> Instruction:
    """The instruction `line` whose result type starts at `start` (a shape, or a tuple of them)."""
    end = _closing(line, start) if line[start] == "(" else line.index(" ", start)
    m = re.match(r"\s*([\w\-]+)\(", line[end:])
    if not m:
        raise ValueError(f"cannot read the opcode of: {line[:200]}")
    args = end + m.end() - 1
    operands = re.findall(r"%([\w.\-]+)", line[args:_closing(line, args)])
    return Instruction(name, line[start:end], m.group(1), operands, line)


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The computations of an HLO module's text ({name: instructions}) and the entry computation's name."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.split("\n"):
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                current = comps.setdefault(m.group(1), [])
                if line.startswith("ENTRY"):
                    entry = m.group(1)
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            current.append(_instruction(m.group(1), line, m.end()))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _category(ins: Instruction) -> str:
    if ins.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', ins.text).group(1)
        if target.startswith("__cublas"):
            return "gemm"
        return "attention" if target in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2") else "custom-call"
    if ins.opcode == "fusion":
        if '"name":"dynamic_slice_fusion"' in ins.text:  # XLA copies the slice (a memcpy in a GPU trace)
            return "copy"
        return "gemm" if any(k in ins.text for k in _GEMM_KINDS) else "fusion"
    if ins.opcode in ("copy", "copy-start"):
        return "copy"
    if ins.opcode.removesuffix("-start") in _COLLECTIVES:
        return "collective"
    return "other"


@dataclasses.dataclass
class Launches:
    """What one run of a computation launches, counted from its optimized HLO."""
    by_category: Counter  # kernels by kind: gemm, attention, fusion, copy, collective, custom-call, other
    by_layer: Counter  # kernels by layer index (ops named `layer_i`); -1: outside every layer
    loops: int  # while loops run (each counted as its known trip count times its body and condition)
    unknown_trips: int  # of them, loops whose trip count XLA does not know (counted once)
    conditionals: list[tuple[int, ...]]  # per run of a conditional, its branches' kernel counts (it counts 1 + min)

    @property
    def skipped(self) -> int:
        """Launches the conditionals' costliest branches would add to their cheapest."""
        return sum(max(b) - min(b) for b in self.conditionals)

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    def per_layer(self) -> float:
        layers = [n for i, n in self.by_layer.items() if i >= 0]
        return sum(layers) / len(layers) if layers else 0.0


def _layer_pattern():
    from models.llama import LAYER_SCOPE

    return re.compile(rf'op_name="[^"]*?\b{LAYER_SCOPE}(\d+)/')


def count_launches(text: str) -> Launches:
    """Kernels one run of the HLO module `text` (optimized, as `compiled.as_text()` gives it) launches: every
    instruction of the entry computation but views, tuples, parameters and constants is one launch (a fusion is
    one kernel, a custom call one, a copy one memcpy); a while loop runs its condition and body its known trip
    count of times (once where unknown; the condition's last, exiting run is not counted); a conditional counts
    one (its predicate's copy to the host) plus its cheapest branch, and its branches are listed; a call runs its
    computation. Each launch is put in the layer its op's name says (`layer_i/`), or the enclosing op's."""
    comps, entry = parse_hlo(text)
    layer_of = _layer_pattern()
    cats, layers = Counter(), Counter()
    loops = [0, 0]
    conditionals = []

    def run(name: str, times: int, layer: int, sink: tuple[Counter, Counter]):
        for ins in comps[name]:
            m = layer_of.search(ins.text)
            where = int(m.group(1)) if m else layer
            if ins.opcode in _FREE or ins.opcode.endswith("-done"):
                continue
            if ins.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
                loops[0] += 1
                loops[1] += trips is None
                for c in ins.runs():  # condition, body
                    run(c, times * (int(trips.group(1)) if trips else 1), where, sink)
            elif ins.opcode == "conditional":
                counted = []
                for b in ins.runs():
                    c = (Counter(), Counter())
                    run(b, 1, where, c)
                    counted.append(c)
                conditionals.extend([tuple(sum(c[0].values()) for c in counted)] * times)
                cheapest = min(counted, key=lambda c: sum(c[0].values()))
                sink[0]["other"] += times
                sink[1][where] += times
                for k, v in cheapest[0].items():
                    sink[0][k] += v * times
                for k, v in cheapest[1].items():
                    sink[1][k] += v * times
            elif ins.opcode == "call":
                run(ins.attr("to_apply"), times, where, sink)
            else:  # a kernel or copy
                sink[0][_category(ins)] += times
                sink[1][where] += times

    run(entry, 1, -1, (cats, layers))
    return Launches(cats, layers, loops[0], loops[1], conditionals)


def layer_kernels(text: str, layer: int) -> list[str]:
    """The kernels and copies of layer `layer` (ops named `layer_<layer>/`) in the HLO module `text`, in program
    order, one line each: category, name, result type. While loops' bodies and calls' computations are walked (each
    kernel listed once, whatever the trip count); conditionals are left out (`count_launches` counts them)."""
    comps, entry = parse_hlo(text)
    layer_of = _layer_pattern()
    found = []

    def walk(name: str, where: int):
        for ins in comps[name]:
            m = layer_of.search(ins.text)
            here = int(m.group(1)) if m else where
            if ins.opcode in _FREE or ins.opcode.endswith("-done") or ins.opcode == "conditional":
                continue
            if ins.opcode in ("while", "call"):
                for c in ins.runs():
                    walk(c, here)
            elif here == layer:
                found.append(f"{_category(ins):<10} {ins.name:<36} {ins.type[:70]}")

    walk(entry, -1)
    return found


def _executed(comps: dict[str, list[Instruction]], entry: str) -> list[str]:
    """The computations whose instructions run as launches (not fused computations' bodies): the entry and what
    its while loops, conditionals and calls run, transitively."""
    names, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name in names:
            continue
        names.append(name)
        todo += [c for ins in comps[name] for c in ins.runs()]
    return names


_VIEWS = {"parameter", "get-tuple-element", "bitcast", "constant"}


def _dims(type_: str) -> tuple[str, tuple[int, ...]] | None:
    m = re.fullmatch(r"(\w+)\[([\d,]*)\](?:\{[^}]*\})?", type_)
    return (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) if m else None


def _scalar(ins: Instruction) -> bool:
    dims = _dims(ins.type)
    return dims is not None and dims[1] == ()


def weight_copies(hlo: str, shapes) -> list[str]:
    """Instructions of the optimized HLO `hlo` that run (not inside a fusion) and make a float array of one of
    `shapes` (the layer weights') out of stored arrays alone (parameters of the step, constants, scalars, or
    elements and views of them, followed into while loops and conditionals): a copy of a weight, or of its slice
    of stacked weights, each step. A matmul reading a weight and an activation of the same shape is not one."""
    comps, entry = parse_hlo(hlo)
    by_name = {c: {i.name: i for i in comps[c]} for c in comps}
    callers: dict[str, tuple[str, list[str]]] = {}  # computation -> (caller, what its parameters are there)
    for c in _executed(comps, entry):
        for ins in comps[c]:
            for i, callee in enumerate(ins.runs()):  # a branch's parameter is its operand; the others', all
                callers[callee] = (c, [ins.operands[1 + i]] if ins.opcode == "conditional" else ins.operands)

    def stored(comp: str, name: str, index: int | None = None) -> bool:
        """Whether `name` in `comp` (its tuple element `index`, if given) is a stored array or a scalar."""
        ins = by_name[comp][name]
        if index is None and _scalar(ins):
            return True
        if ins.opcode == "constant" or (ins.opcode == "parameter" and comp == entry):
            return True
        if ins.opcode == "parameter" and comp in callers:
            caller, args = callers[comp]
            return stored(caller, args[int(re.search(r"parameter\((\d+)\)", ins.text).group(1))], index)
        if ins.opcode == "tuple" and index is not None:
            return stored(comp, ins.operands[index])
        if ins.opcode == "get-tuple-element":
            return stored(comp, ins.operands[0], int(re.search(r"index=(\d+)", ins.text).group(1)))
        return ins.opcode == "bitcast" and stored(comp, ins.operands[0], index)

    found = []
    for c in _executed(comps, entry):
        for ins in comps[c]:
            dims = _dims(ins.type)
            if (dims is None or dims[0] not in ("f32", "bf16", "f16") or dims[1] not in shapes
                    or ins.opcode in _VIEWS):
                continue
            arrays = [o for o in ins.operands if not _scalar(by_name[c][o])]
            if arrays and all(stored(c, o) for o in ins.operands):  # reads a stored array (not only scalars: a fill)
                found.append(ins.text.strip()[:160])
    return found


# ------------------------------------------------------------------------------------------------ compiling
LOCAL = "local"  # --target for this machine's own devices (the step as it would compile here)


def target_devices(target: str, count: int):
    """`count` devices to compile for: compile-only devices of the GPU `target` (a key of `TARGETS`), from jax's
    CUDA plugin, or this machine's own (`LOCAL`)."""
    import jax
    from jax.experimental import topologies

    if target == LOCAL:
        return jax.devices()[:count]
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target],
                                                topology=f"1x1x{count}")
    except Exception as e:  # no CUDA plugin: jax says "Unknown backend" or that the platform has no topology
        raise RuntimeError(
            f"compiling for {target} needs jax's CUDA plugin (no GPU): pip install \"jax[cuda12]=={jax.__version__}\""
            f" ({type(e).__name__}: {str(e)[:200]})") from e
    return topology.devices


def abstract_executor(model: str, dtype: str, attention: str, *, kvp: int = 1, spp: int = 1, tp: int = 1,
                      max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, page_size: int = 16):
    """An `Executor` of a preset's step on this machine's first kvp*spp*tp devices whose parameters are abstract
    (nothing of the model's size is made): it can lower (`Executor.lower_shape`), not run. Its KV cache holds
    two pages per sequence (the step's code does not depend on how many)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from mnemojax.engine.executor import Executor
    from mnemojax.engine.llm_engine import EngineConfig
    from models.config import preset
    from models.llama import ModelSpec
    from models.params import abstract_step_params
    from shardings.mesh import make_mesh
    from shardings.specs import ShardingTable

    mc, table = preset(model), ShardingTable()
    mesh = make_mesh(kvp, spp, tp)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), table.params(mc.tie_word_embeddings))
    params = abstract_step_params(mc, dtype=jnp.dtype(dtype), tp=tp, spp=spp, shardings=shardings)
    spec = ModelSpec(mc, dtype, 8, attention)
    return Executor(spec, params, mesh, num_pages=2 * max_num_seqs + 2, page_size=page_size,
                    max_num_seqs=max_num_seqs, max_pages_per_seq=-(-max_model_len // page_size),
                    max_num_batched_tokens=max_num_batched_tokens, max_tokens_per_rank=None, table=table,
                    max_logit_bias=EngineConfig.max_logit_bias)  # the engine's default step


def step_shapes(executor, batch: int) -> list[tuple[int, int, str]]:
    """One (T, R, kind) of each kind: `batch` decodes; a prefill chunk filling the token budget; the budget's
    rows shared by `batch` - 1 decodes and a chunk (the shapes the engine's buckets give them). With the reference
    attention every step is `mixed` (one step for every kind), at the same shapes."""
    from mnemojax.scheduling.buckets import bucket
    from models.kernels import DECODE, MIXED, PREFILL

    if batch > executor.max_num_seqs:
        raise ValueError(f"batch ({batch}) exceeds max_num_seqs ({executor.max_num_seqs})")
    T = executor.pipeline_tokens or bucket(executor.max_num_batched_tokens, 16)
    D = executor.pipeline_tokens or bucket(batch, 16)  # a pipeline's micro-batches all have T rows
    kinds = (DECODE, PREFILL, MIXED) if executor.kinds else (MIXED,) * 3  # the reference has one step
    return [(D, executor.logits_rows(D, batch), kinds[0]), (T, executor.logits_rows(T, 1), kinds[1]),
            (T, executor.logits_rows(T, batch), kinds[2])]


def layer_weight_shapes(executor) -> set[tuple[int, ...]]:
    """The shapes a layer's weight matrices have in the compiled step: each device's share ([1, ...]: its stage's
    slot of the [spp, ...] array, and its tp share of heads or columns), and the same without the stage axis."""
    import jax

    shapes = set()
    for a in jax.tree.leaves(executor.params["layers"]):
        if a.ndim >= 3:
            local = tuple(a.sharding.shard_shape(a.shape))
            shapes |= {local, local[1:]}
    return shapes


@dataclasses.dataclass
class Compiled:
    T: int
    R: int
    kind: str
    launches: Launches
    weight_copies: int
    temp_mib: float  # the step's scratch memory on the device (XLA's memory analysis), besides its arguments
    seconds: float
    layer: list[str] = dataclasses.field(default_factory=list)  # `--show_layer`'s kernels (`layer_kernels`)


def resolve_auto(model: str, dtype: str, page_size: int, mesh) -> str:
    """What attention `auto` is for `model` on the target whose devices the abstract `mesh` holds: the engine's rule
    (`models.attention.resolve_for_model`), asked under that mesh so that `models.attention.target_device` sees the
    target rather than this machine."""
    import jax

    from models.attention import resolve_for_model
    from models.config import preset
    from models.kernels import AUTO

    with jax.sharding.use_abstract_mesh(mesh):
        return resolve_for_model(AUTO, preset(model), dtype, page_size)


def compile_step(executor, T: int, R: int, kind: str, devices, show_layer: int | None = None) -> Compiled:
    """The step of shape (T, R, kind) compiled for `devices` (compile-only or real), and what it launches (and the
    kernels of layer `show_layer`, when given)."""
    from shardings.mesh import make_mesh

    mesh = make_mesh(executor.kvp, executor.spp, executor.tp, devices=devices)
    t = time.perf_counter()
    compiled = executor.lower_shape(T, R, kind, mesh=mesh).compile()
    seconds = time.perf_counter() - t
    text = compiled.as_text()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    shapes = layer_weight_shapes(executor)
    return Compiled(T, R, kind, count_launches(text), len(weight_copies(text, shapes)), temp, seconds,
                    [] if show_layer is None else layer_kernels(text, show_layer))


def table(rows: list[tuple[str, Compiled]], num_layers: int) -> str:
    lines = [f"{'attention':<10} {'kind':<8} {'T':>5} {'R':>4} {'launches':>8} {'/layer':>7} {'outside':>7} "
             f"{'gemm':>5} {'attn':>5} {'fusion':>6} {'copy':>5} {'other':>5} {'cond.+':>6} {'w.copies':>8} "
             f"{'temp MiB':>8} {'compile s':>9}"]
    for impl, c in rows:
        n = c.launches
        cat = n.by_category
        lines.append(f"{impl:<10} {c.kind:<8} {c.T:>5} {c.R:>4} {n.total:>8} {n.per_layer():>7.1f} "
                     f"{n.by_layer[-1]:>7} {cat['gemm']:>5} {cat['attention']:>5} {cat['fusion']:>6} "
                     f"{cat['copy']:>5} {cat['other'] + cat['custom-call'] + cat['collective']:>5} "
                     f"{n.skipped:>6} {c.weight_copies:>8} {c.temp_mib:>8.1f} {c.seconds:>9.1f}")
    lines.append(f"({num_layers} layers. launches: the kernels and copies one run of the step starts, counted in its "
                 "optimized HLO; /layer: the mean over layers, outside: the embedding, the attention plan, the final "
                 "norm, logits and sampler; gemm: matmuls, attn: attention kernels, other: conditionals' predicates "
                 "and the rest. A conditional counts its cheapest branch (a greedy step's: no top-k / top-p, no "
                 "log-prob top-k); cond.+: what its costliest branches would add. w.copies: weight copies. temp "
                 "MiB: the step's scratch memory on the device besides its arguments, by XLA's memory analysis)")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--attention", default="pallas", help="comma-separated implementations (models.kernels)")
    p.add_argument("--target", default="h100", choices=sorted(TARGETS) + [LOCAL],
                   help=f"the GPU to compile for, or {LOCAL}: this machine's devices (its CPU unless JAX_PLATFORMS "
                        "names another platform)")
    p.add_argument("--batch", type=int, default=1, help="sequences of the decode and mixed steps")
    p.add_argument("--max_num_batched_tokens", type=int, default=2048)
    p.add_argument("--max_model_len", type=int, default=131072)
    p.add_argument("--max_num_seqs", type=int, default=None, help="default: max(batch, 8)")
    p.add_argument("--all_shapes", action="store_true",
                   help="compile every step shape the engine compiles at start-up (Executor.shape_buckets) instead "
                        "of one of each kind: whether all compile for the target, and how long that takes here")
    p.add_argument("--show_layer", type=int, default=None,
                   help="also list the kernels of this layer of each step (category, name, result type)")
    p.add_argument("--kvp", type=int, default=1)
    p.add_argument("--spp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    devices_needed = args.kvp * args.spp * args.tp
    if "jax" not in sys.modules:  # a command: the executor's own arrays sit on this machine's CPUs
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        if devices_needed > 1:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + f" --xla_force_host_platform_device_count={devices_needed}")
    import jax

    from mnemojax.bench import print_header

    print_header(argv)
    devices = target_devices(args.target, devices_needed)
    how = "this machine's" if args.target == LOCAL else "compile-only: XLA's deviceless compilation, no autotuning"
    print(f"target: {devices[0].device_kind} x {devices_needed} ({how}); "
          f"{args.model} {args.dtype}, mesh kvp={args.kvp} spp={args.spp} tp={args.tp}, "
          f"batch {args.batch}, token budget {args.max_num_batched_tokens}, max_model_len {args.max_model_len}, "
          f"jax {jax.__version__}")
    rows = []
    for impl in args.attention.split(","):
        if impl == "auto":  # as the engine resolves it on the target, for this model (`resolve_for_model`)
            from shardings.mesh import make_mesh

            target = make_mesh(args.kvp, args.spp, args.tp, devices=devices).abstract_mesh
            impl = resolve_auto(args.model, args.dtype, 16, target)  # 16: abstract_executor's page size
            print(f"attention auto: {impl} on {devices[0].device_kind} for {args.model} {args.dtype}", flush=True)
        executor = abstract_executor(args.model, args.dtype, impl, kvp=args.kvp, spp=args.spp, tp=args.tp,
                                     max_num_seqs=args.max_num_seqs or max(args.batch, 8),
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     max_model_len=args.max_model_len)
        shapes = executor.shape_buckets() if args.all_shapes else step_shapes(executor, args.batch)
        for T, R, kind in shapes:
            rows.append((impl, compile_step(executor, T, R, kind, devices, args.show_layer)))
            print(f"compiled {impl} {kind} T={T} R={R} in {rows[-1][1].seconds:.1f} s", flush=True)
            if args.show_layer is not None:
                kernels = rows[-1][1].layer
                print(f"  layer {args.show_layer}'s {len(kernels)} kernels:\n    " + "\n    ".join(kernels),
                      flush=True)
    print(table(rows, len(executor.params["layers"])))
    if args.all_shapes:
        for impl in dict(rows):
            seconds = sorted(c.seconds for i, c in rows if i == impl)
            print(f"{impl}: {len(seconds)} step shapes compiled in {sum(seconds):.1f} s on this machine (median "
                  f"{seconds[len(seconds) // 2]:.1f} s, longest {seconds[-1]:.1f} s; no autotuning), scratch up to "
                  f"{max(c.temp_mib for i, c in rows if i == impl):.1f} MiB")
