"""Loading Hugging Face Llama safetensors checkpoints straight into sharded parameters.

`SafetensorsReader` is a small safetensors reader over `np.memmap`: a tensor is a lazy view of the file, so
reading a slice of it touches only those bytes, and bfloat16 needs no torch (`ml_dtypes`).

`load_hf_params` builds every parameter with `jax.make_array_from_callback`: the callback gets the index of
one device's shard and reads only that part of the HF tensors (the layers in the slice; for a projection the
rows it needs, transposed after reading). A partially replicated shard is read once and shared by its
devices. Host memory in flight is therefore at most the distinct shards of one parameter on this process.

HF name -> parameter (letters: L layers, D hidden, H heads, K kv heads, Dh head dim, F MLP width, V vocab;
HF stores linear weights as [out, in]; its q/k rows are already in rotate-half RoPE order):
    model.embed_tokens.weight                 [V, D]     -> embed        [V, D]
    model.layers.{i}.input_layernorm.weight   [D]        -> attn_norm    [L, D]
    ...self_attn.q_proj.weight                [H*Dh, D]  -> wq           [L, D, H, Dh]
    ...self_attn.k_proj.weight / v_proj       [K*Dh, D]  -> wk / wv      [L, D, K, Dh]
    ...self_attn.o_proj.weight                [D, H*Dh]  -> wo           [L, H, Dh, D]
    model.layers.{i}.post_attention_layernorm.weight     -> mlp_norm     [L, D]
    ...mlp.gate_proj.weight / up_proj         [F, D]     -> w_gate/w_up  [L, D, F]
    ...mlp.down_proj.weight                   [D, F]     -> w_down       [L, F, D]
    model.norm.weight                         [D]        -> final_norm   [D]
    lm_head.weight                            [V, D]     -> lm_head      [D, V]  (absent when tied)

Checks, all made before any parameter is built, each error naming the tensor and the directory:
- a missing tensor, a tensor of the wrong shape, a non-float tensor, and any tensor we do not map are errors;
- `*.rotary_emb.inv_freq` buffers (written by old transformers versions) are skipped: RoPE is computed from the
  config;
- `lm_head.weight` in a checkpoint whose config ties the embeddings: transformers (5.x) keeps it untied when it
  differs from the embedding and ties it when equal. Our tied parameters have no `lm_head`, so we accept it only
  when it equals `model.embed_tokens.weight` (then skip it) and otherwise raise, suggesting
  `tie_word_embeddings: false` - never silently dropping a trained head.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from models.config import json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

SAFETENSORS_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_DTYPES = ("BF16", "F16", "F32")

SKIPPED_TENSORS = re.compile(r"(.*\.)?rotary_emb\.inv_freq")
"""Non-persistent RoPE buffers that old transformers versions saved; recomputed from the config."""


# ----------------------------------------------------------------------------------------------------------
# Safetensors reader.


class SafetensorsReader:
    """Lazy read access to the tensors of a checkpoint directory: one `model.safetensors` (preferred when both
    exist, as in transformers), or the shards listed in `model.safetensors.index.json` (`weight_map`: tensor
    name -> file name)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"checkpoint directory {self.path} does not exist")
        single = os.path.join(self.path, SINGLE_FILE)
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(single):
            files = {SINGLE_FILE: None}
        elif os.path.exists(index):
            weight_map = json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index} has no 'weight_map' object (tensor name -> file name)")
            files = {name: None for name in sorted(set(weight_map.values()))}
        else:
            found = sorted(os.listdir(self.path))
            raise FileNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path} (it holds: {', '.join(found) or 'nothing'}); "
                "only safetensors checkpoints can be loaded")
        self._files: dict[str, _SafetensorsFile] = {}
        self._where: dict[str, str] = {}  # tensor name -> file name
        for file_name in files:
            st = _SafetensorsFile(os.path.join(self.path, file_name))
            self._files[file_name] = st
            for name in st.headers:
                if name in self._where:
                    raise ValueError(f"tensor {name} is stored twice in {self.path}: in {self._where[name]} "
                                     f"and in {file_name}")
                self._where[name] = file_name
        if os.path.exists(index) and not os.path.exists(single):
            for name, file_name in weight_map.items():
                if self._where.get(name) != file_name:
                    raise ValueError(f"{INDEX_FILE} in {self.path} puts tensor {name} in {file_name}, "
                                     f"but that file does not hold it")

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header(name).shape

    def dtype(self, name: str) -> str:
        """The safetensors dtype string, e.g. "BF16"."""
        return self._header(name).dtype

    def array(self, name: str) -> np.ndarray:
        """The whole tensor as a read-only view of the file: nothing is read until it is indexed or copied."""
        return self._files[self._file_of(name)].array(name)

    def _file_of(self, name: str) -> str:
        if name not in self._where:
            raise KeyError(f"no tensor {name} in {self.path}")
        return self._where[name]

    def _header(self, name: str) -> _TensorHeader:
        return self._files[self._file_of(name)].headers[name]


@dataclasses.dataclass(frozen=True)
class _TensorHeader:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file
    end: int


class _SafetensorsFile:
    """One safetensors file: 8-byte little-endian header length, a JSON header, then the raw tensor bytes."""

    def __init__(self, file: str):
        self.file = file
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ValueError(f"{file} is not a safetensors file (shorter than 8 bytes)")
            (header_len,) = np.frombuffer(prefix, "<u8")
            size = os.path.getsize(file)
            if 8 + int(header_len) > size:
                raise ValueError(f"{file} is not a safetensors file (header length {header_len} > file size)")
            try:
                header = json.loads(f.read(int(header_len)))
            except ValueError as e:
                raise ValueError(f"{file} is not a safetensors file (its header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{file} is not a safetensors file (its header is not a JSON object)")
        data_start = 8 + int(header_len)
        self.headers: dict[str, _TensorHeader] = {}
        for name, h in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = h["data_offsets"]
                shape = tuple(h["shape"])
                if (not all(type(v) is int and v >= 0 for v in (begin, end, *shape)) or begin > end
                        or not isinstance(h["dtype"], str)):
                    raise TypeError
                t = _TensorHeader(h["dtype"], shape, data_start + begin, data_start + end)
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"tensor {name} in {file}: its header needs dtype, shape and data_offsets [begin, "
                                 f"end] (integers >= 0), got {h!r}") from None
            itemsize = SAFETENSORS_DTYPES[t.dtype].itemsize if t.dtype in SAFETENSORS_DTYPES else None
            if itemsize is not None and t.end - t.begin != math.prod(t.shape) * itemsize:
                raise ValueError(f"tensor {name} in {file}: {t.end - t.begin} bytes for shape {t.shape} {t.dtype}")
            if t.end > size:
                raise ValueError(f"tensor {name} in {file} runs past the end of the file (truncated?)")
            self.headers[name] = t
        # As the safetensors library checks: the tensors tile the data, each where the one before ends, so none
        # reads another's bytes or the header's.
        at = data_start
        for name, t in sorted(self.headers.items(), key=lambda item: (item[1].begin, item[1].end)):
            if t.begin != at:
                raise ValueError(f"tensor {name} in {file} starts at data byte {t.begin - data_start}, not where the "
                                 f"tensors before it end ({at - data_start}): overlapping or a gap")
            at = t.end
        if at != size:
            raise ValueError(f"{file} has {size - at} bytes after its last tensor's data")
        self._mmap = np.memmap(file, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def array(self, name: str) -> np.ndarray:
        t = self.headers[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} in {self.file} has unsupported dtype {t.dtype}")
        return self._mmap[t.begin:t.end].view(SAFETENSORS_DTYPES[t.dtype]).reshape(t.shape)


def stored_dtype(path: str | os.PathLike) -> str:
    """The dtype name ("float32", "bfloat16" or "float16") every weight of the checkpoint at `path` is stored in;
    float32 when they differ (or one is of another type, which loading refuses)."""
    reader = SafetensorsReader(path)
    found = {SAFETENSORS_DTYPES[d].name if (d := reader.dtype(name)) in FLOAT_DTYPES else "float32"
             for name in reader.names() if not SKIPPED_TENSORS.fullmatch(name)}
    return found.pop() if len(found) == 1 else "float32"


# ----------------------------------------------------------------------------------------------------------
# Loading.

PARAM_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def load_hf_params(path: str | os.PathLike, config=None, dtype=np.float32, shardings=None, *,
                   progress: bool = True) -> dict:
    """The parameters (the pytree of `models.params.param_shapes(config)`) of the HF Llama checkpoint at `path`.

    Args:
      path: a directory with `model.safetensors` or `model.safetensors.index.json` and its shards.
      config: the `LlamaConfig` the parameters must match; None reads `path/config.json`.
      dtype: parameter dtype (jnp.float32, jnp.bfloat16 or jnp.float16); stored tensors are cast to it.
      shardings: a pytree like the parameters of `jax.sharding.Sharding`s; each device receives only its shard,
        read from the file for it. None puts everything on the first local device.
      progress: show a tqdm progress bar over the checkpoint's tensors.

    Raises FileNotFoundError for a missing directory, config or weights file, and ValueError for a missing,
    unexpected, mis-shaped or non-float tensor (see the module docstring), each naming the tensor.
    """
    path = os.fspath(path)
    if config is None:
        from models.config import LlamaConfig

        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"no config.json in {path}" if os.path.isdir(path)
                                    else f"checkpoint directory {path} does not exist")
        config = LlamaConfig.from_pretrained(path)
    dtype = np.dtype(dtype)
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"parameter dtype must be float32, bfloat16 or float16, got {dtype}")
    reader = SafetensorsReader(path)
    sources = _sources(config)
    _check_tensors(reader, sources, config)

    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, sources)
    if jax.tree.structure(shardings) != jax.tree.structure(sources):
        raise ValueError(f"shardings must have the structure of the parameters: expected "
                         f"{jax.tree.structure(sources)}, got {jax.tree.structure(shardings)}")

    L = config.num_layers
    total = sum(len(s.names(L)) for s in jax.tree.leaves(sources))
    with tqdm(total=total, unit="tensor", desc=f"Loading {path}", disable=not progress) as bar:

        def load(source: _Source, sharding) -> jax.Array:
            shards: dict[tuple, np.ndarray] = {}  # devices holding the same part share one host copy

            def callback(index):
                key = tuple((s.start, s.stop, s.step) for s in index)
                if key not in shards:
                    shards[key] = source.read(reader, index, L, dtype)
                return shards[key]

            array = jax.make_array_from_callback(source.shape(L), sharding, callback, dtype=dtype)
            bar.update(len(source.names(L)))
            return array

        return jax.tree.map(load, sources, shardings)


def _check_tensors(reader: SafetensorsReader, sources: dict, config) -> None:
    """Raises unless the checkpoint holds exactly the tensors `sources` expects (module docstring)."""
    L = config.num_layers
    expected = {}
    for source in jax.tree.leaves(sources):
        for name in source.names(L):
            expected[name] = source.stored
    for name, shape in expected.items():
        if name not in reader:
            raise ValueError(f"missing tensor {name} in {reader.path}")
        if reader.shape(name) != shape:
            raise ValueError(f"tensor {name} in {reader.path} has shape {reader.shape(name)}, but the config "
                             f"expects {shape}")
        if reader.dtype(name) not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name} in {reader.path} has dtype {reader.dtype(name)}; expected one of "
                             f"{', '.join(FLOAT_DTYPES)}")
    unexpected = [n for n in reader.names() if n not in expected and not SKIPPED_TENSORS.fullmatch(n)]
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")
        _check_tied_head(reader)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"unexpected tensor {unexpected[0]}{more} in {reader.path}: not a parameter of a "
                         f"Llama model with this config ({config.num_layers} layers, "
                         f"tie_word_embeddings={config.tie_word_embeddings})")


def _check_tied_head(reader: SafetensorsReader, rows_per_chunk: int = 4096) -> None:
    """Accepts a stored `lm_head.weight` in a tied checkpoint only if it equals the embedding."""
    head, embed = reader.array("lm_head.weight"), reader.array("model.embed_tokens.weight")
    equal = head.shape == embed.shape and all(
        np.array_equal(head[r:r + rows_per_chunk].astype(np.float32),
                       embed[r:r + rows_per_chunk].astype(np.float32))
        for r in range(0, head.shape[0], rows_per_chunk))
    if not equal:
        raise ValueError(f"tensor lm_head.weight in {reader.path} differs from model.embed_tokens.weight, but the "
                         "config ties them (tie_word_embeddings: true); transformers would use it untied - set "
                         "tie_word_embeddings to false to load it")


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if x.dtype == dtype:
        return x
    if x.dtype != np.float32 and dtype != np.float32:
        x = x.astype(np.float32)  # bfloat16 <-> float16 via float32: exact, then one rounding
    return x.astype(dtype)


# ----------------------------------------------------------------------------------------------------------
# HF tensors -> parameter pytree.


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a parameter comes from: the HF tensor `name` (with `{i}` per layer for a stacked parameter), stored
    as `stored`, is reshaped to `view` and its axes permuted: `param = view.transpose(perm)`, with a leading
    layer axis when stacked."""

    name: str
    stored: tuple[int, ...]
    view: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name

    def names(self, num_layers: int) -> list[str]:
        return [self.name.format(i=i) for i in range(num_layers)] if self.stacked else [self.name]

    def shape(self, num_layers: int) -> tuple[int, ...]:
        """The parameter's shape."""
        return ((num_layers,) if self.stacked else ()) + tuple(self.view[p] for p in self.perm)

    def read(self, reader: SafetensorsReader, index: tuple[slice, ...], num_layers: int, dtype) -> np.ndarray:
        """The part `index` (one slice per parameter axis) of the parameter in `dtype`, reading only the rows
        of the HF tensors that it needs."""
        shape = self.shape(num_layers)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        out = np.empty(tuple(len(range(n)[s]) for n, s in zip(shape, index)), dtype)
        if self.stacked:
            layers, index = range(num_layers)[index[0]], index[1:]
        view_index = [slice(None)] * len(self.view)
        for out_axis, view_axis in enumerate(self.perm):
            view_index[view_axis] = index[out_axis]
        view_index = tuple(view_index)

        def part(name):
            # Basic slicing of the memmap view reads nothing yet; the assignment below reads just these bytes.
            return reader.array(name).reshape(self.view)[view_index].transpose(self.perm)

        if not self.stacked:
            out[...] = _cast(part(self.name), dtype)
        for j, i in enumerate(layers if self.stacked else ()):
            out[j] = _cast(part(self.name.format(i=i)), dtype)
        return out


def _sources(config) -> dict:
    """The `_Source` of every parameter, in the structure of `models.params.param_shapes(config)`."""
    c = config
    D, H, K, Dh, F, V = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                         c.vocab_size)
    layer = "model.layers.{i}."
    sources = {
        "embed": _Source("model.embed_tokens.weight", (V, D), (V, D), (0, 1)),
        "layers": {
            "attn_norm": _Source(layer + "input_layernorm.weight", (D,), (D,), (0,)),
            "wq": _Source(layer + "self_attn.q_proj.weight", (H * Dh, D), (H, Dh, D), (2, 0, 1)),
            "wk": _Source(layer + "self_attn.k_proj.weight", (K * Dh, D), (K, Dh, D), (2, 0, 1)),
            "wv": _Source(layer + "self_attn.v_proj.weight", (K * Dh, D), (K, Dh, D), (2, 0, 1)),
            "wo": _Source(layer + "self_attn.o_proj.weight", (D, H * Dh), (D, H, Dh), (1, 2, 0)),
            "mlp_norm": _Source(layer + "post_attention_layernorm.weight", (D,), (D,), (0,)),
            "w_gate": _Source(layer + "mlp.gate_proj.weight", (F, D), (F, D), (1, 0)),
            "w_up": _Source(layer + "mlp.up_proj.weight", (F, D), (F, D), (1, 0)),
            "w_down": _Source(layer + "mlp.down_proj.weight", (D, F), (D, F), (1, 0)),
        },
        "final_norm": _Source("model.norm.weight", (D,), (D,), (0,)),
    }
    if not c.tie_word_embeddings:
        sources["lm_head"] = _Source("lm_head.weight", (V, D), (V, D), (1, 0))
    return sources
