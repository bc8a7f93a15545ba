"""Orbax checkpoints: HF -> Orbax conversion (the script), restore onto meshes other than the one saved from,
exact values, target shardings and per-device shard shapes, dtype casts, and errors naming the parameter."""
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint import v1 as ocp

from models.checkpoint import load_hf_params
from models.config import LlamaConfig
from models.orbax_io import (MARKER_FILE, copy_tokenizer_files, is_orbax_checkpoint, read_marker, restore_params,
                             save_params)
from models.params import param_shapes
from shardings.mesh import make_mesh
from shardings.specs import ShardingTable
from tests.hf_utils import make_hf_checkpoint
from tests import REPO

REPO = REPO
SCRIPT = os.path.join(REPO, "scripts", "convert_checkpoint.py")

# 4 layers, 8 heads, 4 kv heads, MLP 128, vocab 320: every split of the meshes below is even.
HF_ARGS = dict(num_layers=4, hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=128)
SAVE_MESH = (2, 2, 2)
RESTORE_MESHES = [(1, 1, 1), (1, 2, 4), (4, 1, 2)]  # (kvp, spp, tp), all different from SAVE_MESH


def _load_script():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shardings(mesh, config):
    specs = ShardingTable().params(config.tie_word_embeddings)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"untied"/"tied": (hf_dir, orbax_dir)}: the untied one converted by running the script in a subprocess,
    the tied one by calling its main(); both saved from the 2x2x2 mesh, float32."""
    root = tmp_path_factory.mktemp("orbax")
    out = {}
    for name, tie in (("untied", False), ("tied", True)):
        hf = make_hf_checkpoint(root / f"hf_{name}", tie_word_embeddings=tie, seed=int(tie), **HF_ARGS)
        out[name] = (hf, str(root / f"orbax_{name}"))
    mesh_flags = [f"--{a}={n}" for a, n in zip(("kvp", "spp", "tp"), SAVE_MESH)]
    hf, dst = out["untied"]
    run = subprocess.run([sys.executable, SCRIPT, "--hf_dir", hf, "--output_dir", dst, "--dtype", "float32",
                          *mesh_flags], capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"Converted {hf} -> {dst}" in run.stdout and "stored as float32" in run.stdout
    hf, dst = out["tied"]
    assert _load_script().main(["--hf_dir", hf, "--output_dir", dst, *mesh_flags]) == dst  # --dtype auto
    return out


@pytest.fixture(scope="module")
def references(ckpts):
    """The HF-loaded float32 parameters of each checkpoint, as numpy."""
    return {name: jax.tree.map(np.asarray, load_hf_params(hf, dtype=np.float32, progress=False))
            for name, (hf, _) in ckpts.items()}


def _expected_local_shape(shape, spec, mesh):
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(n // (1 if axis is None else mesh.shape[axis]) for n, axis in zip(shape, spec))


@pytest.mark.parametrize("mesh_shape", RESTORE_MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_restore_on_other_meshes_is_exact(ckpts, references, name, mesh_shape):
    _, path = ckpts[name]
    config = LlamaConfig.from_pretrained(path)
    mesh = make_mesh(*mesh_shape)
    shardings = _shardings(mesh, config)
    params = restore_params(path, config, jnp.float32, shardings)

    assert jax.tree.map(lambda a: a.shape, params) == param_shapes(config)
    specs = ShardingTable().params(config.tie_word_embeddings)
    for (key, got), want, sharding, spec in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(references[name]),
            jax.tree.leaves(shardings), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        where = jax.tree_util.keystr(key)
        assert got.dtype == jnp.float32, where
        assert got.sharding == sharding, where
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=where)
        local = _expected_local_shape(got.shape, spec, mesh)
        assert len(got.addressable_shards) == math.prod(mesh_shape), where
        for shard in got.addressable_shards:
            assert shard.data.shape == local, where
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=where)

    kvp, spp, tp = mesh_shape
    L, D, H, K, Dh, F = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                         config.head_dim, config.intermediate_size)
    layers = params["layers"]
    assert layers["wq"].addressable_shards[0].data.shape == (L // spp, D, H // tp, Dh)
    assert layers["wk"].addressable_shards[0].data.shape == (L // spp, D, K // tp, Dh)
    assert layers["wo"].addressable_shards[0].data.shape == (L // spp, H // tp, Dh, D)
    assert layers["w_down"].addressable_shards[0].data.shape == (L // spp, F // tp, D)
    assert ("lm_head" in params) == (name == "untied")


def test_checkpoint_files(ckpts):
    for name, (hf, path) in ckpts.items():
        assert LlamaConfig.from_pretrained(path) == LlamaConfig.from_pretrained(hf)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            with open(os.path.join(hf, f), "rb") as a, open(os.path.join(path, f), "rb") as b:
                assert a.read() == b.read(), f
        marker = read_marker(path)
        assert marker["dtype"] == "float32"  # the tied one used --dtype auto on a float32 checkpoint
        assert marker["num_parameters"] == sum(math.prod(s) for s in jax.tree.leaves(
            param_shapes(LlamaConfig.from_pretrained(path)), is_leaf=lambda x: isinstance(x, tuple)))


def test_restore_casts_to_bfloat16(ckpts):
    hf, path = ckpts["untied"]
    mesh = make_mesh(1, 2, 4)
    config = LlamaConfig.from_pretrained(path)
    params = restore_params(path, config, jnp.bfloat16, _shardings(mesh, config))
    want = load_hf_params(hf, config, jnp.bfloat16, progress=False)  # numpy's float32 -> bfloat16 rounding
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(ref).view(np.uint16))


def test_bfloat16_storage_and_default_placement(ckpts, tmp_path):
    """A bf16-stored checkpoint restores to float32 exactly; config=None and shardings=None read config.json
    and use one device."""
    hf, _ = ckpts["tied"]
    config = LlamaConfig.from_pretrained(hf)
    bf16 = load_hf_params(hf, config, ml_dtypes.bfloat16, progress=False)
    path = save_params(bf16, tmp_path / "bf16", config)
    assert read_marker(path)["dtype"] == "bfloat16"
    params = restore_params(path)
    device = jax.local_devices()[0]
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(bf16)):
        assert got.dtype == jnp.float32 and got.sharding.device_set == {device}
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref).astype(np.float32))


def test_mismatched_checkpoint_names_the_parameter(ckpts):
    _, path = ckpts["untied"]
    config = LlamaConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=r"parameter layers/attn_norm .* has shape \(4, 64\).*expects \(2, 64\)"):
        restore_params(path, dataclasses.replace(config, num_layers=2))
    with pytest.raises(ValueError, match=r"parameter embed .* has shape \(320, 64\).*expects \(384, 64\)"):
        restore_params(path, dataclasses.replace(config, vocab_size=384))
    with pytest.raises(ValueError, match="unexpected parameter lm_head"):
        restore_params(path, dataclasses.replace(config, tie_word_embeddings=True))
    _, tied_path = ckpts["tied"]
    with pytest.raises(ValueError, match="missing parameter lm_head"):
        restore_params(tied_path, dataclasses.replace(config, tie_word_embeddings=False))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        restore_params(path, config, jnp.int32)


def test_checkpoint_saved_from_another_config(ckpts, tmp_path):
    """A checkpoint whose stored tree disagrees with its config.json (e.g. written for 2 layers, config says 4)."""
    hf, path = ckpts["untied"]
    config = LlamaConfig.from_pretrained(hf)
    small = dataclasses.replace(config, num_layers=2)
    params = jax.tree.map(lambda s: np.zeros(s, np.float32), param_shapes(small),
                          is_leaf=lambda x: isinstance(x, tuple))
    bad = save_params(params, tmp_path / "bad", small)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f)
    with pytest.raises(ValueError, match=r"parameter layers/attn_norm in checkpoint .* has shape \(2, 64\)"):
        restore_params(bad)


def test_save_refuses_bad_trees_and_directories(ckpts, tmp_path):
    hf, _ = ckpts["untied"]
    config = LlamaConfig.from_pretrained(hf)
    params = jax.tree.map(lambda s: np.zeros(s, np.float32), param_shapes(config),
                          is_leaf=lambda x: isinstance(x, tuple))
    missing = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "wv"}}
    with pytest.raises(ValueError, match="missing parameter layers/wv"):
        save_params(missing, tmp_path / "a", config)
    with pytest.raises(ValueError, match=r"parameter layers/wo .* has shape \(4, 8, 8\)"):
        save_params({**params, "layers": {**params["layers"], "wo": np.zeros((4, 8, 8), np.float32)}},
                    tmp_path / "a", config)
    with pytest.raises(ValueError, match="parameter final_norm has dtype float16"):
        save_params({**params, "final_norm": params["final_norm"].astype(np.float16)}, tmp_path / "a", config)
    assert not os.path.exists(tmp_path / "a")
    with pytest.raises(FileExistsError, match="not empty"):  # never writes over a source checkpoint
        save_params(params, hf, config, overwrite=True)
    out = save_params(params, tmp_path / "again", config)
    with pytest.raises(FileExistsError, match="not empty"):
        save_params(params, out, config)
    save_params(jax.tree.map(lambda x: x + 1, params), out, config, overwrite=True)
    assert np.all(np.asarray(restore_params(out)["final_norm"]) == 1)


def test_is_orbax_checkpoint(ckpts, tmp_path):
    hf, path = ckpts["untied"]
    assert is_orbax_checkpoint(path)
    assert not is_orbax_checkpoint(hf)
    assert not is_orbax_checkpoint(tmp_path / "nowhere")
    assert not is_orbax_checkpoint(os.path.join(hf, "config.json"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not is_orbax_checkpoint(empty)
    plain = tmp_path / "plain"  # an Orbax checkpoint that save_params did not write
    ocp.save(plain, {"w": np.ones(3, np.float32)}, checkpointable_name="params")
    assert not is_orbax_checkpoint(plain)
    (plain / MARKER_FILE).write_text("not json")
    assert not is_orbax_checkpoint(plain)
    with pytest.raises(FileNotFoundError, match="not a mnemojax Orbax checkpoint"):
        restore_params(hf)


def test_copy_tokenizer_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "special_tokens_map.json").write_text("{}")
    (src / "model.safetensors").write_text("")
    assert copy_tokenizer_files(src, dst) == ["tokenizer.json", "special_tokens_map.json"]
    assert sorted(os.listdir(dst)) == ["special_tokens_map.json", "tokenizer.json"]


@pytest.mark.parametrize("mesh_flags", [["--spp=3", "--tp=2"], ["--tp=8"]], ids=["layers", "kv_heads"])
def test_script_on_a_mesh_that_does_not_divide_the_shapes(ckpts, references, tmp_path, mesh_flags):
    """4 layers over spp=3, or 4 kv heads over tp=8: that axis is replicated while converting."""
    hf, _ = ckpts["tied"]
    out = _load_script().main(["--hf_dir", hf, "--output_dir", str(tmp_path / "out"), *mesh_flags])
    for got, want in zip(jax.tree.leaves(restore_params(out)), jax.tree.leaves(references["tied"])):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_script_auto_dtype_and_overwrite(tmp_path):
    """--dtype auto keeps a bfloat16 checkpoint's dtype; --overwrite replaces an earlier conversion."""
    hf = make_hf_checkpoint(tmp_path / "hf", dtype="bfloat16", tokenizer=False, **HF_ARGS)
    out = str(tmp_path / "out")
    script = _load_script()
    script.main(["--hf_dir", hf, "--output_dir", out, "--dtype", "float32"])
    assert read_marker(out)["dtype"] == "float32"
    with pytest.raises(FileExistsError):
        script.main(["--hf_dir", hf, "--output_dir", out])
    script.main(["--hf_dir", hf, "--output_dir", out, "--overwrite"])
    assert read_marker(out)["dtype"] == "bfloat16"
    config = LlamaConfig.from_pretrained(hf)
    got = restore_params(out, config, ml_dtypes.bfloat16)
    want = load_hf_params(hf, config, ml_dtypes.bfloat16, progress=False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
