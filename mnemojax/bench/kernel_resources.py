"""What ptxas makes of the Mosaic GPU attention kernels: registers, spills and SMEM per kernel and option, on any
machine, a CPU-only one included.

    python scripts/kernel_resources.py [--model llama3-8b] [--chunks 1,32,2048] [--context 1048576]
        [--impl mosaic,mosaic+max_registers=true,mosaic+overlap=true] [--target h100] [--sass]

From jax 0.11, XLA's compilation of a step for an NVIDIA GPU compiles its Mosaic GPU kernels too: Mosaic lowers
each to PTX and assembles it with ptxas then, not when the kernel first runs. So a deviceless compilation (jax's
CUDA plugin, compile-only devices of the `--target` GPU, as `scripts/aot_step.py`; no GPU, driver or CUDA install)
with Mosaic's dumps on (`MOSAIC_GPU_DUMP_TO`: every dump, ptxas's report among them) gives ptxas's own report of
every kernel:
registers per thread, bytes of local memory spilled (stores, loads) and the stack. For each `--impl` label
(`impl+name=value` kernel options, as `scripts/bench_attention.py`'s) and chunk, one layer's attention at the
model's shape (q heads, kv heads, head dim; bf16, pages of 16) is compiled on the step's plan for the step's kind
(chunk 1: decode tiles, one sequence at `--context` keys; else a chunk of that many tokens ending at `--context`:
prefill tiles), and each kernel's report is read: the attention kernel (`paged_attention_mosaic`) and the merge
kernel of its split tiles (`paged_attention_merge`). The label `attention_mgpu` compiles jax's own
FlashAttention-3-style kernel instead (`jax.experimental.pallas.ops.gpu.attention_mgpu`, as
`scripts/bench_attention.py` times it beside ours: f16, contiguous K/V, all keys, 64-row blocks of q per consumer,
128-key blocks; chunks and contexts of multiples of 128): its key-block loop is the one to compare ours with.

A thread of a program of W warpgroups may take at most 65,536 / (128 W) registers (rounded down to 8): 168 for a
two-consumer prefill program (with its producer), 128 for three consumers, unless the program redistributes them
(`max_registers`: `setmaxnreg`, the consumers up to 232 or 160); past that, ptxas spills to local memory. A spill in
a compute-bound kernel's key-block loop costs local-memory traffic every block; elsewhere (the prologue, the output
staging) little. `--sass` says which: it assembles the dumped PTX itself (ptxas and nvdisasm of a CUDA toolkit as
new as the PTX, found on PATH or in `--cuda_bin`: `pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm`; its
registers may differ a little from the report's, which Mosaic's own ptxas made), finds the innermost loops that
issue wgmma (HGMMA: the key-block loops, unmasked and masked) and counts their instructions (a consumer thread's
per key block), exponentials (MUFU.EX2), selects (FSEL: two a score in a masked loop, none in the unmasked one) and
local stores and loads (STL, LDL).

`per SM`: how many programs of a kernel an SM runs at once (`programs_an_sm`: its registers, its threads from the
PTX's `.maxntid`, its SMEM). The decode plan chooses its KV partitions for one wave of programs by SMEM alone,
before anything is compiled (`programs_per_sm`), and ptxas is free to use up to 255 registers a thread (Mosaic asks
for one block an SM); so after the table a line compares, for the default kernel's decode launch (label `mosaic`,
chunk 1), the programs an SM the plan assumes with those the compiled kernel fits, and says when the default
partitions would take two waves instead of one (at head dim 64 the kernel has 126 registers a thread where 128
still lets two programs share an SM).

These are the compiler's facts about the code, not timings: what they cost is measured on a GPU
(`scripts/bench_attention.py`). Prints the command, the target and jax's version, then a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from models.kernels import MOSAIC

_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"smem_scratch_bytes=(\d+)")
_KERNEL_FILE = re.compile(r"^(?P<name>.+)_(?P<index>\d+)$")
_MAXNTID = re.compile(r"^\s*\.maxntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", re.M)  # the PTX's threads a block
# Hopper's (sm_90) limits on what one SM runs at once
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 8  # per thread: registers are given to a warp 256 at a time
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
ATTENTION_MGPU = "attention_mgpu"  # `--impl` label of jax's `attention_mgpu` (f16, block_q 64, block_kv 128)


@dataclasses.dataclass
class KernelReport:
    """One kernel's resources, as ptxas (and Mosaic's resource count) report them."""
    name: str  # the kernel's name (`paged_attention_mosaic`, `paged_attention_merge`)
    registers: int  # per thread, as the launch asks (a `setmaxnreg` program's warpgroups then move them)
    stack: int  # bytes per thread
    spill_stores: int  # bytes per thread
    spill_loads: int
    smem: int | None  # bytes of SMEM scratch Mosaic allocates (None: not reported)
    index: int = 0  # Mosaic's count of the kernels it compiled (its dump files' suffix)
    stem: str = ""  # the dump files' name, less the extension
    loops: list | str | None = None  # `--sass`: (instructions, HGMMA, MUFU.EX2, FSEL, STL, LDL) a loop, or why
    # it failed
    threads: int | None = None  # a program's threads (the PTX's .maxntid; None: no PTX dumped)


def programs_an_sm(registers: int, threads: int, smem: int | None) -> int:
    """How many programs (CUDA blocks) of a kernel an SM can run at once on Hopper: the fewest that its registers
    (`registers` a thread, rounded up to 8, of 65,536), its threads (of 2,048), its SMEM (`smem` bytes and the 1 KB
    the system reserves a block, of 228 KB; None: not counted) and the 32 blocks an SM holds allow. E.g. a decode
    program at head dim 128: 181 -> 184 registers x 256 threads = 47,104 of 65,536, so one, whatever its SMEM; at
    head dim 64: 126 -> 128 x 256 = 32,768, so two where the SMEM fits two."""
    from models.mosaic_attention import SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK

    per_thread = -(-registers // REGISTER_UNIT) * REGISTER_UNIT
    fits = [REGISTERS_PER_SM // (per_thread * threads), THREADS_PER_SM // threads, BLOCKS_PER_SM]
    if smem is not None:
        fits.append(SMEM_PER_SM // (smem + SMEM_RESERVED_PER_BLOCK))
    return min(fits)


def read_ptxas(text: str) -> tuple[int, int, int, int]:
    """(registers, stack, spill store bytes, spill load bytes) of ptxas's -v report `text` (one entry function)."""
    used = _PTXAS_USED.search(text)
    spills = _PTXAS_SPILLS.search(text)
    if used is None or spills is None:
        raise ValueError(f"not a ptxas report of one kernel: {text[:200]!r}")
    return int(used.group(1)), int(spills.group(1)), int(spills.group(2)), int(spills.group(3))


def read_dump(folder: str) -> list[KernelReport]:
    """The kernels Mosaic dumped into `folder` (`<name>_<i>.ptxas`, `<name>_<i>.resources.txt`), in the order
    they were compiled."""
    reports = []
    for path in glob.glob(os.path.join(folder, "*.ptxas")):
        stem = os.path.basename(path)[:-len(".ptxas")]
        m = _KERNEL_FILE.match(stem)
        name, index = (m.group("name"), int(m.group("index"))) if m else (stem, 0)
        registers, stack, stores, loads = read_ptxas(open(path).read())
        smem = None
        resources = os.path.join(folder, stem + ".resources.txt")
        if os.path.exists(resources):
            found = _SMEM.search(open(resources).read())
            smem = int(found.group(1)) if found else None
        threads = None
        ptx = os.path.join(folder, stem + ".ptx")
        if os.path.exists(ptx):
            found = _MAXNTID.search(open(ptx).read())
            threads = math.prod(int(x) for x in found.groups()) if found else None
        reports.append(KernelReport(name, registers, stack, stores, loads, smem, index, stem, threads=threads))
    return sorted(reports, key=lambda r: r.index)


_INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+\S")  # nvdisasm's address comment, then the instruction


def sass_loops(sass: str) -> list[tuple[int, int, int, int, int, int]]:
    """(instructions, HGMMA, MUFU.EX2, FSEL, STL, LDL) of each innermost loop of the disassembly `sass` (nvdisasm
    -c) that issues wgmma. A loop is a label and the furthest backward branch to it, with no unpredicated EXIT
    between them (ptxas outlines an mbarrier wait's retry after the function's EXIT, and its branch back into the
    loop's middle is no loop); innermost: it holds no other such loop. FSEL (selects) tell a masked key-block loop
    (two a score) from the unmasked one (none). Instructions: the lines from the label to the back edge."""
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"^\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = i
    furthest = {}  # label line -> its furthest backward branch
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b.*?\.(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            furthest[labels[m.group(1)]] = i
    exits = [i for i, line in enumerate(lines) if re.search(r"\*/\s+EXIT\b", line)]  # unpredicated

    def count(a, b, what):
        return sum(what in x for x in lines[a:b + 1])

    loops = [(a, b) for a, b in furthest.items() if not any(a < e < b for e in exits)]
    with_wgmma = sorted((a, b) for a, b in loops if count(a, b, "HGMMA"))
    inner = [(a, b) for a, b in with_wgmma
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in with_wgmma)]
    return [(sum(bool(_INSTRUCTION.search(x)) for x in lines[a:b + 1]),
             *(count(a, b, what) for what in ("HGMMA", "MUFU.EX2", "FSEL", "STL", "LDL"))) for a, b in inner]


def find_tool(name: str, cuda_bin: str | None) -> str:
    path = shutil.which(name, path=cuda_bin) if cuda_bin else shutil.which(name)
    if path is None:
        raise SystemExit(f"--sass needs {name} (a CUDA toolkit as new as the PTX Mosaic writes): put it on PATH or "
                         "give --cuda_bin (pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm: nvidia/cu13/bin)")
    return path


def disassemble(folder: str, kernel: KernelReport, target: str, tools: tuple[str, str]) -> str:
    """nvdisasm of the kernel's dumped PTX, assembled by `tools` = (ptxas, nvdisasm)."""
    ptxas, nvdisasm = tools
    ptx = os.path.join(folder, f"{kernel.stem}.ptx")
    cubin = ptx[:-len(".ptx")] + ".cubin"
    arch = {"h100": "sm_90a", "h200": "sm_90a"}[target]
    subprocess.run([ptxas, f"-arch={arch}", "-O3", ptx, "-o", cubin], check=True, capture_output=True, text=True)
    return subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout


def compile_layer(*, label: str, chunk: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  page_size: int, device, folder: str):
    """One layer's attention for `label` (`impl+options`) compiled for `device` (compile-only), Mosaic's dumps
    into `folder`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mnemojax.bench.attention import mgpu_config, split_label
    from models.attention import AttentionMetadata, attention, plan_attention, split_kernel_options
    from models.kernels import DECODE, PREFILL
    from shardings.mesh import make_mesh

    mesh = make_mesh(1, 1, 1, devices=[device])
    rep = NamedSharding(mesh, P())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    def compile_dumped(fn, *args):
        step = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        os.environ["MOSAIC_GPU_DUMP_TO"] = folder  # read by Mosaic at each compilation
        try:
            jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).compile()
        finally:
            del os.environ["MOSAIC_GPU_DUMP_TO"]

    if label == ATTENTION_MGPU:  # as `scripts/bench_attention.py` times it beside ours: f16, contiguous K/V
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        if chunk % 128 or context % 128:
            raise ValueError(f"{ATTENTION_MGPU} takes chunks and contexts of multiples of 128, got chunk {chunk}, "
                             f"context {context}")
        config = mgpu_config(128)  # its first choice there (64 only where 128 does not fit)
        kv = sds((1, context, num_kv_heads, head_dim), jnp.float16)
        compile_dumped(lambda q, k, v: attention_mgpu.attention(q, k, v, config=config),
                       sds((1, chunk, num_heads, head_dim), jnp.float16), kv, kv)
        return
    impl, options = split_label(label)
    if impl != MOSAIC:
        raise ValueError(f"--impl {label!r}: only the compiled Mosaic kernels ({MOSAIC}) have a ptxas report")
    plan_opts, call_opts = split_kernel_options(impl, options)
    pages = -(-context // page_size)
    q = sds((chunk, num_heads, head_dim), jnp.bfloat16)
    cache = sds((1, pages + 1, page_size, num_kv_heads, head_dim), jnp.bfloat16)
    meta = AttentionMetadata(seq_ids=sds((chunk,), jnp.int32), positions=sds((chunk,), jnp.int32),
                             page_table=sds((1, pages), jnp.int32), kv_lens=sds((1,), jnp.int32),
                             kv_start=sds((1,), jnp.int32))
    kind = DECODE if chunk == 1 else PREFILL  # the step's kind, as the engine passes it
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)

    def layer(q, k, v, meta):
        plan = plan_attention(impl, meta, kind=kind, **dims, **plan_opts)
        return attention(impl, q, k, v, jnp.int32(0), meta, block_pages=8, kind=kind, plan=plan, **call_opts)

    compile_dumped(layer, q, cache, cache, meta)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help="a preset whose attention shape to compile (q heads, kv "
                   "heads, head dim)")
    p.add_argument("--impl", default=MOSAIC, help="comma-separated labels, impl+name=value kernel options, or "
                   f"{ATTENTION_MGPU} (jax's own FlashAttention-3-style kernel, as the attention benchmark runs it)")
    p.add_argument("--chunks", default="1,32,2048", help="query tokens per step: 1 = decode")
    p.add_argument("--context", type=int, default=1 << 20, help="keys of the sequence after the step")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--target", default="h100", choices=("h100", "h200"))
    p.add_argument("--sass", action="store_true", help="also count HGMMA, MUFU.EX2, FSEL and the local stores / loads "
                   "in the key-block loops (needs ptxas and nvdisasm)")
    p.add_argument("--cuda_bin", default=None, help="folder of ptxas and nvdisasm for --sass (default: PATH)")
    args = p.parse_args(argv)
    args.impls = [x for x in args.impl.split(",") if x]
    try:
        args.chunk_list = [int(x) for x in args.chunks.split(",") if x]
    except ValueError:
        p.error(f"--chunks takes comma-separated ints, got {args.chunks!r}")
    if not args.impls or not args.chunk_list or min(args.chunk_list) < 1:
        p.error("--impl and --chunks need at least one entry each, chunks >= 1")
    if max(args.chunk_list) > args.context:
        p.error(f"--chunks: a chunk ends at --context ({args.context}) keys, so may not exceed it")
    from mnemojax.bench.attention import split_label
    for label in args.impls:
        if label == ATTENTION_MGPU:
            continue
        try:
            impl, _ = split_label(label)
        except ValueError as e:
            p.error(f"--impl: {e}")
        if impl != MOSAIC:
            p.error(f"--impl {label!r}: only the compiled Mosaic kernels ({MOSAIC}) have a ptxas report")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices come from the CUDA plugin, not a GPU
    tools = (find_tool("ptxas", args.cuda_bin), find_tool("nvdisasm", args.cuda_bin)) if args.sass else None
    import jax

    from models.config import preset

    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a cached executable would dump nothing
    try:
        _report(args, tools, preset(args.model), argv)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)


def _report(args, tools, config, argv) -> None:
    """The compilations and the table of `main`."""
    import jax

    from mnemojax.bench.aot_step import target_devices

    device = target_devices(args.target, 1)[0]
    print("command: python scripts/kernel_resources.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"target: {device.device_kind} (compile-only: XLA's deviceless compilation, Mosaic's ptxas report); "
          f"{args.model} attention shape: {config.num_heads} q heads, {config.num_kv_heads} kv "
          f"heads, head dim {config.head_dim}, bf16, pages of {args.page_size}; context {args.context}; "
          f"jax {jax.__version__}")
    rows = []
    for label in args.impls:
        for chunk in args.chunk_list:
            folder = tempfile.mkdtemp(prefix="kernel_resources_")
            try:
                compile_layer(label=label, chunk=chunk, context=args.context, num_heads=config.num_heads,
                              num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                              page_size=args.page_size, device=device, folder=folder)
                kernels = read_dump(folder)
                if not kernels:
                    raise RuntimeError("no ptxas report was dumped: jax >= 0.11 compiles Mosaic kernels with XLA")
                for kernel in kernels if tools else ():
                    try:  # a disassembly that fails keeps the kernel's ptxas report
                        kernel.loops = sass_loops(disassemble(folder, kernel, args.target, tools))
                    except (OSError, subprocess.CalledProcessError) as e:
                        kernel.loops = f"--sass failed: {(getattr(e, 'stderr', None) or str(e)).strip()[:200]}"
                rows += [(label, chunk, k) for k in kernels]
            except Exception as e:  # one label that does not compile is reported, the others still run
                rows.append((label, chunk, f"{type(e).__name__}: {str(e)[:160]}"))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    print_table(rows, args.sass)
    for line in check_decode_waves(rows, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim):
        print(line)


def check_decode_waves(rows, *, num_kv_heads: int, head_dim: int) -> list[str]:
    """Lines comparing, for the default kernel's decode launch (label `mosaic`, chunk 1), the programs an SM the
    plan assumes (`programs_per_sm`: by SMEM alone, before anything is compiled; `default_partitions` gives decode
    tiles SMs x that // kv heads partitions, one wave) with what the compiled kernel's registers, threads and SMEM
    allow (`programs_an_sm`). Where the kernel fits fewer, the default partitions make two waves of programs, each
    holding its SM, instead of one (the sixteenth session measured such a launch 10% slower at 256K); ptxas is not
    told to keep to fewer registers (the PTX asks for one block an SM), so a kernel change can cross that line."""
    from models.mosaic_attention import BLOCK_K, SMS, default_partitions, programs_per_sm

    lines = []
    for label, chunk, k in rows:
        if label != MOSAIC or chunk != 1 or isinstance(k, str) or k.name != "paged_attention_mosaic" \
                or k.threads is None:
            continue
        planned = programs_per_sm(consumers=1, head_dim=head_dim, block_k=BLOCK_K)
        fit = programs_an_sm(k.registers, k.threads, k.smem)
        parts = default_partitions(consumers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, block_k=BLOCK_K)
        waves = -(-parts * num_kv_heads // (SMS * fit))
        verdict = "as planned" if fit >= planned else (
            f"FEWER than planned: the default {parts} partitions x {num_kv_heads} kv heads make {waves} waves of "
            f"programs on {SMS} SMs, not one")
        lines.append(f"decode programs an SM at head dim {head_dim}: the plan assumes {planned}, the compiled kernel "
                     f"fits {fit} ({k.registers} registers x {k.threads} threads, {k.smem} bytes of SMEM): {verdict}")
    return lines


def print_table(rows, sass: bool) -> None:
    head = (f"{'label':44} {'chunk':>6} {'kernel':24} {'regs':>5} {'spill st':>8} {'spill ld':>8} {'stack':>6} "
            f"{'smem':>7} {'per SM':>6}")
    if sass:
        head += "  key-block loops (instr/HGMMA/EX2/FSEL/STL/LDL)"
    print(head)
    for label, chunk, k in rows:
        if isinstance(k, str):
            print(f"{label:44} {chunk:>6} failed: {k}")
            continue
        line = (f"{label:44} {chunk:>6} {k.name:24} {k.registers:>5} {k.spill_stores:>8} {k.spill_loads:>8} "
                f"{k.stack:>6} {k.smem if k.smem is not None else '-':>7} "
                f"{programs_an_sm(k.registers, k.threads, k.smem) if k.threads else '-':>6}")
        if sass and k.loops is not None:
            line += "  " + (k.loops if isinstance(k.loops, str) else " ".join("/".join(map(str, x)) for x in k.loops))
        print(line)
    print("(regs: per thread as launched; spill st / ld: bytes of local memory per thread ptxas spilled to; smem: "
          "Mosaic's SMEM scratch, bytes; per SM: programs an SM runs at once by its registers, threads and SMEM)")


if __name__ == "__main__":
    main()
