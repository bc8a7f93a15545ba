"""`mnemojax.bench.aot_step`: counting a compiled step's launches, the weight-copy check, abstract parameters, and
the step traced for a GPU this machine lacks. The deviceless compile itself needs jax's CUDA plugin (not in the
test extra); `scripts/aot_step.py` runs it and docs/benchmarks.md records its output."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from mnemojax.bench.aot_step import (abstract_executor, count_launches, layer_kernels, layer_weight_shapes, main,
                                     parse_hlo, resolve_auto, weight_copies)
from models.attention import TargetDevice, on_hopper_gpu, on_nvidia_gpu, target_device
from models.kernels import DECODE, MIXED, PREFILL
from shardings.mesh import KVP, SPP, TP

# The shape of XLA's optimized GPU HLO (as `compiled.as_text()` prints it), written by hand: two layers' fusions,
# a Triton gemm fusion, an attention kernel, a copy, a while loop of known trip count, a conditional.
HLO = """HloModule jit_step, is_scheduled=true

%fused_norm (param_0: bf16[16,64]) -> bf16[16,64] {
  %param_0 = bf16[16,64]{1,0} parameter(0)
  ROOT %multiply.1 = bf16[16,64]{1,0} multiply(%param_0, %param_0)
}

%body (arg: (s32[], bf16[16,64])) -> (s32[], bf16[16,64]) {
  %arg = (s32[], bf16[16,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[16,64]{1,0} get-tuple-element(%arg), index=1
  %loop_fusion = bf16[16,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_norm
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_norm
  ROOT %t = (s32[], bf16[16,64]{1,0}) tuple(%next, %loop_fusion)
}

%cond (arg.1: (s32[], bf16[16,64])) -> pred[] {
  %arg.1 = (s32[], bf16[16,64]{1,0}) parameter(0)
  ROOT %lt = pred[] fusion(%arg.1), kind=kLoop, calls=%fused_norm
}

%greedy (p: bf16[16,64]) -> s32[16] {
  %p = bf16[16,64]{1,0} parameter(0)
  ROOT %argmax = s32[16]{0} fusion(%p), kind=kInput, calls=%fused_norm
}

%sampled (p.1: bf16[16,64]) -> s32[16] {
  %p.1 = bf16[16,64]{1,0} parameter(0)
  %a = bf16[16,64]{1,0} fusion(%p.1), kind=kLoop, calls=%fused_norm
  %b = bf16[16,64]{1,0} fusion(%a), kind=kLoop, calls=%fused_norm
  ROOT %c = s32[16]{0} fusion(%b), kind=kInput, calls=%fused_norm
}

ENTRY %main (w: bf16[64,64], x: bf16[16,64], flag: pred[]) -> (bf16[16,64], s32[16]) {
  %w = bf16[64,64]{1,0} parameter(0), metadata={op_name="w"}
  %x.1 = bf16[16,64]{1,0} parameter(1), metadata={op_name="x"}
  %flag = pred[] parameter(2)
  %w.view = bf16[64,64]{0,1} bitcast(%w)
  %norm.0 = bf16[16,64]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/shard_map/layer_0/mul"}
  %gemm.0 = bf16[16,64]{1,0} fusion(%norm.0, %w), kind=kCustom, calls=%fused_norm, metadata={op_name="jit(step)/shard_map/layer_0/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %attn.0 = (bf16[16,64]{1,0}, f32[16]{0}) custom-call(%gemm.0), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/shard_map/layer_0/pallas_call"}
  %o.0 = bf16[16,64]{1,0} get-tuple-element(%attn.0), index=0
  %norm.1 = bf16[16,64]{1,0} fusion(%o.0), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/shard_map/layer_1/mul"}
  %copy.1 = bf16[16,64]{1,0} copy(%norm.1), metadata={op_name="jit(step)/shard_map/layer_1/copy"}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,64]{1,0}) tuple(%zero, %copy.1)
  %loop = (s32[], bf16[16,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %h = bf16[16,64]{1,0} get-tuple-element(%loop), index=1
  %tokens = s32[16]{0} conditional(%flag, %h, %h), true_computation=%sampled, false_computation=%greedy
  ROOT %out = (bf16[16,64]{1,0}, s32[16]{0}) tuple(%h, %tokens)
}
"""


def test_count_launches_of_a_hand_written_module():
    comps, entry = parse_hlo(HLO)
    assert entry == "main" and set(comps) == {"fused_norm", "body", "cond", "greedy", "sampled", "main"}
    n = count_launches(HLO)
    # layer 0: norm, gemm, attention; layer 1: norm, copy; outside: the loop's 3 x (condition 1 + body 2), the
    # conditional's predicate and its cheapest branch (greedy: 1 kernel; sampled has 3).
    assert dict(n.by_layer) == {0: 3, 1: 2, -1: 9 + 1 + 1}
    assert dict(n.by_category) == {"fusion": 2 + 9 + 1, "gemm": 1, "attention": 1, "copy": 1, "other": 1}
    assert n.total == 16 and n.per_layer() == 2.5
    assert (n.loops, n.unknown_trips, n.conditionals, n.skipped) == (1, 0, [(3, 1)], 2)


def test_layer_kernels_lists_one_layers_launches_in_order():
    """`--show_layer`: layer 0's norm fusion, gemm and attention kernel, layer 1's fusion and copy, by category, name
    and result type; a layer the module lacks has none; the loop and conditional (outside the layers) never."""
    assert [line.split()[:2] for line in layer_kernels(HLO, 0)] == [["fusion", "norm.0"], ["gemm", "gemm.0"],
                                                                     ["attention", "attn.0"]]
    assert layer_kernels(HLO, 0)[2].split()[2] == "(bf16[16,64]{1,0},"
    assert [line.split()[:2] for line in layer_kernels(HLO, 1)] == [["fusion", "norm.1"], ["copy", "copy.1"]]
    assert layer_kernels(HLO, 2) == []


def test_weight_copies_finds_copies_of_stored_arrays_not_matmuls():
    shapes = {(64, 64)}
    assert weight_copies(HLO, shapes) == []  # w only feeds a gemm (and a bitcast)
    copied = HLO.replace("%copy.1 = bf16[16,64]{1,0} copy(%norm.1)", "%copy.1 = bf16[64,64]{1,0} copy(%w)")
    assert [line.split(" =")[0] for line in weight_copies(copied, shapes)] == ["%copy.1"]
    filled = HLO.replace("%copy.1 = bf16[16,64]{1,0} copy(%norm.1)", "%copy.1 = bf16[64,64]{1,0} fusion(%zero)")
    assert weight_copies(filled, shapes) == []  # a fill from a scalar copies nothing
    # At shapes [16, 64] (as when a step's T equals the hidden size): the norm of the input x (a parameter) is
    # made of a stored array alone; the gemm, the norm of the attention's out and the copy of it read activations.
    assert [line.split(" =")[0] for line in weight_copies(HLO, {(16, 64)})] == ["%norm.0"]


def test_weight_copies_finds_the_slices_a_scan_over_stacked_weights_copies():
    """On the CPU-compiled HLO: a scan over stacked weights slices each layer's out (a copy); a loop unrolled over
    per-layer weights reads them in place, though its matmuls make arrays of a weight's shape [32, 48]."""
    w = jnp.ones((4, 32, 48), jnp.float32)

    def scanned(x, w):
        return lax.scan(lambda h, wl: (jnp.tanh(h @ wl @ wl.T), None), jnp.sin(x), w)[0]

    def unrolled(x, ws):
        x = jnp.sin(x)
        for wl in ws:
            x = jnp.tanh(x @ wl @ wl.T)
        return x

    x = jnp.ones((32, 32))
    copies = weight_copies(jax.jit(scanned).lower(x, w).compile().as_text(), {(32, 48)})
    assert copies and all(" dot(" not in line for line in copies), copies
    assert weight_copies(jax.jit(unrolled).lower(x, list(w)).compile().as_text(), {(32, 48)}) == []


def test_count_launches_reads_the_engines_compiled_step_by_layer():
    """The CPU-compiled step of the tiny model (4 layers): each layer's ops carry its name, so each of layers 0-3
    has its launches (XLA's CPU fusion differs a little between them) and the rest are outside."""
    ex = abstract_executor("tiny", "float32", "reference", max_num_seqs=8, max_num_batched_tokens=64,
                           max_model_len=512)
    n = count_launches(ex.lower_shape(64, 8, MIXED).compile().as_text())
    assert set(n.by_layer) == {-1, 0, 1, 2, 3}
    assert all(n.by_layer[i] > 20 for i in range(4)) and n.by_layer[-1] > 0
    assert n.total == sum(n.by_layer.values())  # every launch in one layer or outside, once


def test_weight_shapes_are_each_devices_share_as_the_compiled_step_has_them():
    """The weight-copy check looks for each device's share of a layer's weights (tp 2 here), the shapes the
    compiled step's parameters have, not the whole arrays', which no instruction of it has."""
    ex = abstract_executor("tiny", "float32", "reference", tp=2, max_num_seqs=8, max_num_batched_tokens=64,
                           max_model_len=512)
    comps, entry = parse_hlo(ex.lower_shape(64, 8, MIXED).compile().as_text())
    params = {i.type.split("{")[0] for i in comps[entry] if i.opcode == "parameter"}
    shapes = layer_weight_shapes(ex)
    assert {(1, 128, 4, 16), (128, 4, 16), (1, 128, 1, 16), (1, 4, 16, 128), (1, 128, 128), (1, 128, 128)} <= shapes
    assert all(f"f32[{','.join(map(str, s))}]" in params for s in shapes if len(s) == 4 or s == (1, 128, 128))
    assert not shapes & {(128, 8, 16), (128, 256), (256, 128)}  # the whole arrays'


def test_abstract_step_params_are_the_loaders():
    """What the loader puts on a (kvp 1, spp 2, tp 2) mesh, layer by layer: shapes, dtypes and shardings."""
    from mnemojax.engine.llm_engine import EngineConfig
    from mnemojax.engine.loader import load

    loaded = load(EngineConfig(model="tiny", spp=2, tp=4, dtype="bfloat16", max_model_len=256))
    ex = abstract_executor("tiny", "bfloat16", "reference", spp=2, tp=4, max_num_seqs=8,
                           max_num_batched_tokens=64, max_model_len=256)

    def facts(tree):
        return jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding.spec, a.sharding.mesh.devices.tolist()), tree)

    assert facts(ex.params) == facts(loaded.params)
    assert len(ex.params["layers"]) == 2 and ex.params["layers"][0]["wk"].shape == (2, 128, 4, 16)  # kv heads x2


H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
A100 = AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="gpu")
MI300 = AbstractDevice(device_kind="AMD Instinct MI300X", num_cores=304, platform="gpu")


def _mesh(device):
    return AbstractMesh((1, 1, 1), (KVP, SPP, TP), axis_types=(AxisType.Explicit,) * 3, abstract_device=device)


def test_the_kernels_check_the_device_the_step_is_traced_for():
    assert target_device() == TargetDevice("cpu", "cpu", "", abstract=False)
    assert not on_nvidia_gpu() and not on_hopper_gpu()
    for device, platform, hopper in ((H100, "gpu", True), (A100, "gpu", False), (MI300, "rocm", False)):
        with jax.sharding.use_abstract_mesh(_mesh(device)):
            assert target_device() == TargetDevice(platform, device.device_kind, "", abstract=True)
            assert (on_nvidia_gpu(), on_hopper_gpu()) == (platform == "gpu", hopper), device
    # A mesh of this machine's own devices (a shard_map over them) is this machine: its device, not a name.
    with jax.sharding.use_abstract_mesh(_mesh(AbstractDevice(device_kind="cpu", num_cores=None, platform="cpu"))):
        assert target_device() == TargetDevice("cpu", "cpu", "", abstract=False)


@pytest.mark.parametrize("kind,kernels", [(DECODE, 1), (PREFILL, 1), (MIXED, 2)])
def test_engine_step_lowers_for_an_h100_it_does_not_have(kind, kernels):
    """The step of an executor whose parameters are abstract, lowered over the mesh of an abstract H100 for CUDA:
    the attention switch lets the Triton kernels through (they are for the device the step is traced for) and
    every layer launches the kind's kernels; over this machine's CPU the same step raises."""
    ex = abstract_executor("tiny", "bfloat16", "pallas", max_num_seqs=8, max_num_batched_tokens=64,
                           max_model_len=512)
    T = 16 if kind == DECODE else 64
    text = ex.lower_shape(T, 8, kind, mesh=_mesh(H100), lowering_platforms=("cuda",)).as_text()
    calls = text.count('stablehlo.custom_call @__gpu$xla.gpu.triton')
    names = {line.split('name = "')[1].split('"')[0] for line in text.split("\n")
             if "__gpu$xla.gpu.triton" in line and 'name = "' in line}
    assert calls >= 1 and len(names) == kernels, (calls, names)
    with pytest.raises(RuntimeError, match="attention='pallas' needs an NVIDIA GPU.*traced for 'cpu'"):
        ex.lower_shape(T, 8, kind)
    with pytest.raises(ValueError, match="mesh must have the executor's shape"):
        ex.lower_shape(T, 8, kind, mesh=AbstractMesh((2, 1, 1), (KVP, SPP, TP)))


@pytest.mark.slow  # ~17 s on 2 cores: a benchmark script's smoke run (its helpers' tests stay in the default suite)
def test_the_script_compiles_every_kind_for_this_machine(capsys):
    """`scripts/aot_step.py --target local` (this machine's CPU devices, on a tp=2 mesh): a row per step shape and
    implementation with its launches, no weight copy, and scratch memory."""
    main(["--model", "tiny", "--dtype", "float32", "--attention", "reference,pallas_interpret", "--target", "local",
          "--batch", "4", "--max_num_batched_tokens", "64", "--max_model_len", "512", "--tp", "2"])
    out = capsys.readouterr().out
    assert "target: cpu x 2 (this machine's); tiny float32, mesh kvp=1 spp=1 tp=2, batch 4" in out
    rows = [line.split() for line in out.split("\n") if line.startswith(("reference ", "pallas_interpret "))]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("reference", "mixed", "16", "8"), ("reference", "mixed", "64", "8"), ("reference", "mixed", "64", "8"),
        ("pallas_interpret", "decode", "16", "8"), ("pallas_interpret", "prefill", "64", "8"),
        ("pallas_interpret", "mixed", "64", "8")]
    header = out.split("\n")[[i for i, line in enumerate(out.split("\n")) if line.startswith("attention ")][0]].split()
    for r in rows:
        n = dict(zip(header, r))
        assert int(n["launches"]) > 4 * float(n["/layer"]) > 0 and n["w.copies"] == "0" and float(n["temp"]) > 0


@pytest.mark.slow  # ~11 s on 2 cores: a benchmark script's smoke run (its helpers' tests stay in the default suite)
def test_all_shapes_compiles_every_shape_the_engine_compiles_at_start_up(capsys):
    """`--all_shapes`: each shape of `Executor.shape_buckets()` (what start-up compiles), then a summary line."""
    args = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    main(["--model", "tiny", "--dtype", "float32", "--attention", "reference", "--target", "local", "--all_shapes",
          *[f"--{k}={v}" for k, v in args.items()]])
    out = capsys.readouterr().out
    shapes = abstract_executor("tiny", "float32", "reference", **args).shape_buckets()
    rows = [tuple(line.split()[1:4]) for line in out.split("\n") if line.startswith("reference ")]
    assert rows == [(kind, str(T), str(R)) for T, R, kind in shapes] and len(rows) >= 4
    assert f"reference: {len(shapes)} step shapes compiled in " in out


def test_auto_resolves_as_the_engine_would_on_the_target():
    """`--attention auto` compiles what the engine would run on the target: the Mosaic kernels on an H100 for a
    bf16 Llama-3-8B, the Triton ones for float32 or on an A100, the reference on a CPU."""
    assert resolve_auto("llama3-8b", "bfloat16", 16, _mesh(H100)) == "mosaic"
    assert resolve_auto("llama3-8b", "float32", 16, _mesh(H100)) == "pallas"
    assert resolve_auto("llama3-8b", "bfloat16", 16, _mesh(A100)) == "pallas"
    cpu = AbstractDevice(device_kind="cpu", num_cores=None, platform="cpu")
    assert resolve_auto("llama3-8b", "bfloat16", 16, _mesh(cpu)) == "reference"
