"""Loading HF Llama safetensors checkpoints: layout against torch, dtypes, shards, errors, sharded loading."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from models import checkpoint
from models.checkpoint import SafetensorsReader, load_hf_params
from models.config import LlamaConfig
from models.params import param_shapes
from shardings.mesh import make_mesh
from shardings.specs import ShardingTable
from tests.hf_utils import load_hf_model, make_hf_checkpoint

# name -> make_hf_checkpoint arguments: every stored dtype, one file and shards, tied and untied,
# MHA / GQA / MQA, head_dim other than hidden / heads.
CHECKPOINTS = {
    "f32-gqa": dict(dtype="float32", num_kv_heads=2),
    "bf16-mha-shards": dict(dtype="bfloat16", num_kv_heads=4, max_shard_size="20KB"),
    "f16-mqa-tied-shards": dict(dtype="float16", num_kv_heads=1, tie_word_embeddings=True, max_shard_size="20KB"),
    "f32-tied-headdim": dict(dtype="float32", num_kv_heads=2, head_dim=8, tie_word_embeddings=True, seed=1),
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_hf_checkpoint(root / name, tokenizer=False, **kw) for name, kw in CHECKPOINTS.items()}


def _load(path, dtype=jnp.float32, **kw):
    return load_hf_params(path, LlamaConfig.from_pretrained(path), dtype, progress=False, **kw)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_layout_matches_torch_modules(checkpoints, name):
    """Each parameter computes what its HF module computes, so the transposes / reshapes are right."""
    path = checkpoints[name]
    config = LlamaConfig.from_pretrained(path)
    params = jax.tree.map(np.asarray, _load(path))
    assert jax.tree.map(lambda a: a.shape, params) == param_shapes(config)
    model = load_hf_model(path)  # stored dtype -> float32, exactly
    H, Dh = config.num_heads, config.head_dim
    rng = np.random.default_rng(0)
    x = rng.standard_normal(config.hidden_size).astype(np.float32)
    a = rng.standard_normal((H, Dh)).astype(np.float32)
    y = rng.standard_normal(config.intermediate_size).astype(np.float32)
    t = torch.from_numpy

    def close(ours, module, arg):
        with torch.no_grad():
            want = module(t(arg)).numpy()
        np.testing.assert_allclose(ours, want.reshape(ours.shape), rtol=1e-5, atol=1e-6)

    for i, layer in enumerate(model.model.layers):
        p = jax.tree.map(lambda w: w[i], params["layers"])
        close(np.einsum("d,dnh->nh", x, p["wq"]), layer.self_attn.q_proj, x)
        close(np.einsum("d,dkh->kh", x, p["wk"]), layer.self_attn.k_proj, x)
        close(np.einsum("d,dkh->kh", x, p["wv"]), layer.self_attn.v_proj, x)
        close(np.einsum("nh,nhd->d", a, p["wo"]), layer.self_attn.o_proj, a.reshape(H * Dh))
        close(x @ p["w_gate"], layer.mlp.gate_proj, x)
        close(x @ p["w_up"], layer.mlp.up_proj, x)
        close(y @ p["w_down"], layer.mlp.down_proj, y)
        np.testing.assert_array_equal(p["attn_norm"], layer.input_layernorm.weight.detach().numpy())
        np.testing.assert_array_equal(p["mlp_norm"], layer.post_attention_layernorm.weight.detach().numpy())
    np.testing.assert_array_equal(params["final_norm"], model.model.norm.weight.detach().numpy())
    ids = np.array([0, 5, 256, 319])
    np.testing.assert_array_equal(params["embed"][ids], model.model.embed_tokens(t(ids)).detach().numpy())
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    assert ("lm_head" in params) == (not config.tie_word_embeddings)
    close(x @ head, model.lm_head, x)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_cast_like_jax(checkpoints, name, dtype):
    """Any stored dtype loads into any parameter dtype, rounded as jnp's astype rounds."""
    path = checkpoints[name]
    reference = _load(path, jnp.float32)  # exact: float32 holds every bf16 / f16 value
    params = _load(path, dtype)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want.astype(dtype)).view(np.uint8))


def test_reader_reads_bf16_without_torch(checkpoints):
    path = checkpoints["bf16-mha-shards"]
    reader = SafetensorsReader(path)
    assert len(os.listdir(path)) > 5 and reader.dtype("model.norm.weight") == "BF16"
    state = load_hf_model(path).state_dict()  # float32 upcast of the stored bf16, exact
    for name in reader.names():
        got = reader.array(name)
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == tuple(state[name].shape)
        np.testing.assert_array_equal(got.astype(np.float32), state[name].numpy())


# ------------------------------------------------------------------------------------------ sharded loading


def _specs(tied: bool) -> dict:
    """Splits every kind of axis: layers over spp, heads / F / V / D over tp or kvp, some replication."""
    specs = {
        "embed": P("tp", None),
        "layers": {
            "attn_norm": P("spp", "tp"),
            "wq": P("spp", None, "tp", None),
            "wk": P("spp", "kvp", "tp", None),
            "wv": P("spp", None, None, "tp"),
            "wo": P("spp", "tp", None, "kvp"),
            "mlp_norm": P(None, None),
            "w_gate": P("spp", None, "tp"),
            "w_up": P(None, "kvp", ("spp", "tp")),
            "w_down": P("spp", "tp", None),
        },
        "final_norm": P(None),
    }
    if not tied:
        specs["lm_head"] = P("kvp", "tp")
    return specs


@pytest.mark.parametrize("mesh_shape", [(1, 2, 2), (2, 2, 2)])
@pytest.mark.parametrize("name", ["f32-gqa", "f16-mqa-tied-shards"])
def test_sharded_loading_reads_only_each_shard(checkpoints, monkeypatch, name, mesh_shape):
    path = checkpoints[name]
    config = LlamaConfig.from_pretrained(path)
    full = jax.tree.map(np.asarray, _load(path))
    mesh = make_mesh(*mesh_shape)
    specs = _specs(config.tie_word_embeddings)
    if config.num_kv_heads < 2:  # MQA: one kv head cannot split over tp; split its head dim instead
        specs["layers"]["wk"] = P("spp", "kvp", None, "tp")
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))

    reads = []
    read = checkpoint._Source.read

    def spy(self, reader, index, num_layers, dtype):
        out = read(self, reader, index, num_layers, dtype)
        reads.append((self.name, out.shape))
        return out

    monkeypatch.setattr(checkpoint._Source, "read", spy)
    params = load_hf_params(path, config, jnp.float32, shardings, progress=False)

    for arr, sharding, want in zip(*map(jax.tree.leaves, (params, shardings, full))):
        assert arr.sharding == sharding and len(arr.addressable_shards) == mesh.size
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    # Each distinct shard of each parameter was read once, at its shard shape (no full host copy).
    expected = {}
    for source, arr in zip(jax.tree.leaves(checkpoint._sources(config)), jax.tree.leaves(params)):
        indices = {tuple((s.start, s.stop) for s in sh.index) for sh in arr.addressable_shards}
        expected[source.name] = (len(indices), arr.sharding.shard_shape(arr.shape))
    assert {n: (sum(r[0] == n for r in reads), next(s for m, s in reads if m == n)) for n in expected} == expected


def test_project_sharding_table_loads(checkpoints):
    path = checkpoints["f32-gqa"]
    config = LlamaConfig.from_pretrained(path)
    mesh = make_mesh(2, 2, 2)
    specs = ShardingTable().params(config.tie_word_embeddings)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    params = load_hf_params(path, config, jnp.bfloat16, shardings, progress=False)
    want = _load(path, jnp.bfloat16)
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(ref).view(np.uint16))


def test_progress_bar(checkpoints, capfd):
    path = checkpoints["f32-gqa"]
    load_hf_params(path, None, jnp.float32, progress=True)
    assert "21/21" in capfd.readouterr().err  # 2 layers x 9 + embed, norm, lm_head
    load_hf_params(path, None, jnp.float32, progress=False)
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------- errors


@pytest.fixture
def editable(checkpoints, tmp_path):
    """A copy of the float32 single-file checkpoint, and a function that rewrites its tensors."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["f32-gqa"], path)
    file = path / "model.safetensors"

    def edit(fn):
        tensors = load_file(file)
        fn(tensors)
        save_file(tensors, file, metadata={"format": "pt"})

    return str(path), edit


def _error(path, exc=ValueError, config=None, **kw):
    with pytest.raises(exc) as e:
        load_hf_params(path, config or LlamaConfig.from_pretrained(path), jnp.float32, progress=False, **kw)
    assert str(path) in str(e.value)
    return str(e.value)


def test_missing_tensor(editable):
    path, edit = editable
    edit(lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in _error(path)


def test_missing_layers_for_config(editable):
    path, _ = editable
    config = LlamaConfig.from_pretrained(path)
    more = LlamaConfig(**{**config.__dict__, "num_layers": 3})
    assert "missing tensor model.layers.2." in _error(path, config=more)
    fewer = LlamaConfig(**{**config.__dict__, "num_layers": 1})
    assert "unexpected tensor model.layers.1." in _error(path, config=fewer)


def test_unexpected_tensor(editable):
    path, edit = editable
    edit(lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}))
    assert "unexpected tensor model.layers.0.self_attn.q_norm.weight" in _error(path)


def test_rotary_inv_freq_is_skipped(editable, checkpoints):
    path, edit = editable
    edit(lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)
                             for i in range(2)}))
    for got, want in zip(jax.tree.leaves(_load(path)), jax.tree.leaves(_load(checkpoints["f32-gqa"]))):
        np.testing.assert_array_equal(got, want)


def test_misshaped_tensor(editable):
    path, edit = editable
    edit(lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.ones((16, 64), np.float32)}))
    msg = _error(path)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(16, 64)" in msg and "(32, 64)" in msg


def test_non_float_tensor(editable):
    path, edit = editable
    edit(lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    msg = _error(path)
    assert "model.norm.weight" in msg and "I32" in msg


def test_tied_checkpoint_with_lm_head(checkpoints, tmp_path):
    """transformers ties an lm_head equal to the embedding and keeps a different one untied; we accept the
    first and refuse the second (our tied parameters have no head)."""
    path = tmp_path / "tied"
    shutil.copytree(checkpoints["f32-tied-headdim"], path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, file, metadata={"format": "pt"})
    params = _load(path)
    assert "lm_head" not in params
    np.testing.assert_array_equal(params["embed"], tensors["model.embed_tokens.weight"])
    tensors["lm_head.weight"][3, 5] += 1.0
    save_file(tensors, file, metadata={"format": "pt"})
    msg = _error(path)
    assert "lm_head.weight" in msg and "tie_word_embeddings" in msg


def test_untied_config_needs_lm_head(checkpoints):
    path = checkpoints["f32-tied-headdim"]
    untied = LlamaConfig(**{**LlamaConfig.from_pretrained(path).__dict__, "tie_word_embeddings": False})
    assert "missing tensor lm_head.weight" in _error(path, config=untied)


def test_no_weights_or_config(tmp_path, checkpoints):
    config = LlamaConfig.from_pretrained(checkpoints["f32-gqa"])
    (tmp_path / "config.json").write_text(json.dumps({}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    msg = _error(tmp_path, FileNotFoundError, config=config)
    assert "model.safetensors" in msg and "pytorch_model.bin" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no config.json in {empty}"):
        load_hf_params(empty, None, jnp.float32, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_params(tmp_path / "nowhere", config, jnp.float32, progress=False)


def test_index_naming_wrong_file(checkpoints, tmp_path):
    path = tmp_path / "shards"
    shutil.copytree(checkpoints["bf16-mha-shards"], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    a, b = "model.norm.weight", "model.embed_tokens.weight"
    weight_map[a], weight_map[b] = weight_map[b], weight_map[a]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model." in _error(path) and "does not hold it" in _error(path)


def test_malformed_index_or_header_names_the_file(checkpoints, tmp_path):
    path = tmp_path / "shards"
    shutil.copytree(checkpoints["bf16-mha-shards"], path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert "has no 'weight_map'" in _error(path)
    single = tmp_path / "single"
    shutil.copytree(checkpoints["f32-gqa"], single)
    file = single / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    del header[name]["data_offsets"]
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    new += b" " * (n - len(new))  # same length: the data stays where it was
    file.write_bytes(raw[:8] + new + raw[8 + n:])
    msg = _error(single)
    assert f"tensor {name} in" in msg and "data_offsets" in msg
    file.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])  # a header that is not JSON
    assert "header is not JSON" in _error(single)


def _rewrite_header(file, edit) -> None:
    """Rewrites a safetensors file's JSON header in place as `edit(header)` returns it (the same length, padded
    with spaces, so the data stays where it was)."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    new = json.dumps(edit(json.loads(raw[8:8 + n])), separators=(",", ":")).encode()
    assert len(new) <= n
    file.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])


def test_data_offsets_must_tile_the_data(checkpoints, tmp_path):
    """Offsets that read the header (negative), another tensor's bytes (overlapping), or leave bytes unread are
    refused as the safetensors library refuses them; they loaded garbage weights before."""
    single = tmp_path / "single"
    shutil.copytree(checkpoints["f32-gqa"], single)
    file = single / "model.safetensors"
    raw = file.read_bytes()
    norm = "model.norm.weight"

    def moved(to):
        def edit(header):
            begin, end = header[norm]["data_offsets"]
            header[norm]["data_offsets"] = [to(begin), to(begin) + end - begin]
            return header
        return edit

    _rewrite_header(file, moved(lambda begin: -64))  # 64 bytes before the data: the header's end
    msg = _error(single)
    assert f"tensor {norm} in" in msg and "integers >= 0" in msg
    file.write_bytes(raw)
    _rewrite_header(file, moved(lambda begin: begin - 4))  # reads 4 bytes of the tensor before it
    msg = _error(single)
    assert "overlapping or a gap" in msg
    file.write_bytes(raw + b"\0" * 8)
    assert "8 bytes after its last tensor" in _error(single)
    file.write_bytes(raw)
    _rewrite_header(file, lambda header: list(header))
    assert "header is not a JSON object" in _error(single)


@pytest.mark.parametrize("index", ["[]", "{", '{"weight_map": {"model.norm.weight": 3}}'])
def test_malformed_index_json_names_the_file(checkpoints, tmp_path, index):
    path = tmp_path / "shards"
    shutil.copytree(checkpoints["bf16-mha-shards"], path)
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        load_hf_params(path, LlamaConfig.from_pretrained(path), jnp.float32, progress=False)


def test_truncated_file(editable):
    path, _ = editable
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    assert "truncated" in _error(path)


def test_bad_arguments(checkpoints):
    path = checkpoints["f32-gqa"]
    config = LlamaConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="int32"):
        load_hf_params(path, config, jnp.int32, progress=False)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, param_shapes(config), is_leaf=lambda s: isinstance(s, tuple))
    del shardings["lm_head"]
    with pytest.raises(ValueError, match="structure of the parameters"):
        load_hf_params(path, config, jnp.float32, shardings, progress=False)
