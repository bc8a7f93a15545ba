"""Orbax checkpoints of the parameter pytree: written once (e.g. from a Hugging Face checkpoint by
`scripts/convert_checkpoint.py`), restored straight onto any mesh.

A checkpoint is a directory:
    params/                    Orbax (v1 API) PyTree checkpoint of the plain nested dict of `models.params`
    _CHECKPOINT_METADATA, orbax.checkpoint, ...     Orbax's own bookkeeping
    config.json                `LlamaConfig.to_hf_dict()`: `LlamaConfig.from_pretrained(dir)` reads it back
    mnemojax_checkpoint.json   marker, written last: format name and version, stored dtype, parameter count
    tokenizer.json, ...        tokenizer and generation files copied from the source (`copy_tokenizer_files`)

The arrays are stored with the sharding they had when saved, but that layout does not bind the reader:
`restore_params` gives Orbax abstract targets (`jax.ShapeDtypeStruct` with the wanted sharding and dtype), so each
device reads only its own shard from the files, on any mesh, cast to the requested dtype on the way (no full
host copy of a parameter is ever made). Before reading, the stored tree is checked against
`models.params.param_shapes(config)`; a missing, unexpected or mis-shaped entry is a ValueError that names it.

Uses only `orbax.checkpoint.v1` (`save`, `load`, `metadata`), so orbax-checkpoint >= 0.12.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping

import jax
import numpy as np
from orbax.checkpoint import v1 as ocp

from models.checkpoint import PARAM_DTYPES
from models.config import LlamaConfig
from models.params import param_shapes

PARAMS_DIR = "params"
"""Name of the Orbax checkpointable (the subdirectory) that holds the parameter pytree."""
CONFIG_FILE = "config.json"
MARKER_FILE = "mnemojax_checkpoint.json"
"""Written after everything else: its presence means the checkpoint is complete."""
FORMAT_NAME = "mnemojax-orbax-params"
FORMAT_VERSION = 1

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
)
"""Files of a Hugging Face checkpoint directory besides the weights and config.json that serving needs: the
tokenizer (transformers 5 writes the chat template to `chat_template.jinja`) and the generation defaults
(Llama-3 Instruct lists `<|eot_id|>` as EOS only in `generation_config.json`)."""


# ----------------------------------------------------------------------------------------------------------
# Saving.


def save_params(params: dict, path: str | os.PathLike, config: LlamaConfig, *, overwrite: bool = False) -> str:
    """Writes `params` (the pytree of `param_shapes(config)`, jax Arrays on any sharding or numpy arrays, all of
    one float dtype) as an Orbax checkpoint at `path`; returns `path` as a string.

    `path` must not exist, or be an empty directory. With `overwrite`, an existing mnemojax checkpoint there is
    replaced; any other non-empty directory is refused (it may be the source checkpoint). Call it on every
    process of a multi-process job (each writes its own shards); process 0 writes the JSON files.

    Raises ValueError naming the parameter for a missing, unexpected or mis-shaped entry, or a dtype that is not
    float32 / bfloat16 / float16 or differs between entries; FileExistsError for a `path` it may not replace.
    """
    path = os.path.abspath(os.fspath(path))
    leaves = _flatten(params, "params")
    _check_tree({name: tuple(np.shape(x)) for name, x in leaves.items()}, config, "the parameters to save")
    dtypes = {name: np.dtype(x.dtype) for name, x in leaves.items()}
    dtype = next(iter(dtypes.values()))
    for name, d in dtypes.items():
        if d not in PARAM_DTYPES:
            raise ValueError(f"parameter {name} has dtype {d}; expected float32, bfloat16 or float16")
        if d != dtype:
            raise ValueError(f"parameter {name} has dtype {d}, but {next(iter(dtypes))} has {dtype}: store one dtype")

    replace = False
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise FileExistsError(f"{path} exists and is not a directory")
        if os.listdir(path):
            if not (overwrite and is_orbax_checkpoint(path)):
                raise FileExistsError(
                    f"{path} is not empty; pass an empty or new directory"
                    + (" (overwrite replaces only an existing mnemojax checkpoint)" if overwrite else
                       " (or overwrite=True to replace a mnemojax checkpoint there)"))
        replace = True  # Orbax refuses an existing directory, even an empty one, unless told to overwrite it

    ocp.save(path, params, checkpointable_name=PARAMS_DIR, overwrite=replace)

    if jax.process_index() == 0:
        _write_json(os.path.join(path, CONFIG_FILE), config.to_hf_dict())
        _write_json(os.path.join(path, MARKER_FILE), {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "params": PARAMS_DIR,
            "dtype": dtype.name,
            "num_parameters": int(sum(math.prod(np.shape(x)) for x in leaves.values())),
        })
    return path


def copy_tokenizer_files(src_dir: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copies the `TOKENIZER_FILES` that exist in `src_dir` into `dst`; returns the names copied."""
    src_dir, dst = os.fspath(src_dir), os.fspath(dst)
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst, name))
            copied.append(name)
    return copied


# ----------------------------------------------------------------------------------------------------------
# Reading.


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a complete checkpoint written by `save_params` (a directory with its marker file)."""
    marker = os.path.join(os.fspath(path), MARKER_FILE)
    if not os.path.isfile(marker):
        return False
    try:
        with open(marker, encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def read_marker(path: str | os.PathLike) -> dict:
    """The contents of the marker file (format, format_version, params, dtype, num_parameters).

    Raises FileNotFoundError when `path` is not a mnemojax Orbax checkpoint, ValueError for a format version this
    code cannot read.
    """
    path = os.fspath(path)
    if not is_orbax_checkpoint(path):
        why = "does not exist" if not os.path.exists(path) else f"has no valid {MARKER_FILE}"
        raise FileNotFoundError(f"{path} is not a mnemojax Orbax checkpoint: it {why} "
                                "(write one with scripts/convert_checkpoint.py)")
    with open(os.path.join(path, MARKER_FILE), encoding="utf-8") as f:
        marker = json.load(f)
    version = marker.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format_version {version!r} is not supported by this mnemojax "
                         f"(it reads versions 1..{FORMAT_VERSION})")
    return marker


def restore_params(path: str | os.PathLike, config: LlamaConfig | None = None, dtype=np.float32,
                   shardings=None) -> dict:
    """The parameters stored at `path` by `save_params`, as jax Arrays placed on `shardings` and cast to `dtype`.

    Args:
      path: a checkpoint directory (see `is_orbax_checkpoint`).
      config: the `LlamaConfig` the parameters must match; None reads `path/config.json`.
      dtype: parameter dtype (float32, bfloat16 or float16); the stored arrays are cast to it while reading.
      shardings: a pytree like the parameters of `jax.sharding.Sharding`s, on any mesh (it need not be the one
        the checkpoint was saved from); each device reads only its shard. None puts everything on the first
        local device.

    Raises FileNotFoundError when `path` is not such a checkpoint, and ValueError naming the parameter for a
    stored entry missing, unexpected or shaped differently from what `config` expects, checked before any
    array is read.
    """
    path = os.path.abspath(os.fspath(path))
    marker = read_marker(path)
    if config is None:
        config = LlamaConfig.from_pretrained(path)
    dtype = np.dtype(dtype)
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"parameter dtype must be float32, bfloat16 or float16, got {dtype}")
    params_dir = marker.get("params", PARAMS_DIR)

    stored = _flatten(ocp.metadata(path, checkpointable_name=params_dir).metadata, "stored parameters")
    _check_tree({name: tuple(m.shape) for name, m in stored.items()}, config, f"checkpoint {path}")
    for name, m in stored.items():
        if np.dtype(m.dtype) not in PARAM_DTYPES:
            raise ValueError(f"parameter {name} in checkpoint {path} has dtype {np.dtype(m.dtype)}; expected "
                             "float32, bfloat16 or float16")

    shapes = param_shapes(config)
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes, is_leaf=_is_shape)
    if jax.tree.structure(shardings) != jax.tree.structure(shapes, is_leaf=_is_shape):
        raise ValueError(f"shardings must have the structure of the parameters: expected "
                         f"{jax.tree.structure(shapes, is_leaf=_is_shape)}, got {jax.tree.structure(shardings)}")
    abstract = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
                            shapes, shardings, is_leaf=_is_shape)
    return ocp.load(path, abstract, checkpointable_name=params_dir)


# ----------------------------------------------------------------------------------------------------------
# Helpers.


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def _flatten(tree, what: str, prefix: str = "") -> dict:
    """{"layers/wq": leaf, ...} of a nested mapping; raises ValueError for a non-string key."""
    out = {}
    for key, value in tree.items():
        if not isinstance(key, str):
            raise ValueError(f"{what}: key {prefix}{key!r} is not a string; expected the nested dict of "
                             "models.params.param_shapes")
        if isinstance(value, Mapping):
            out.update(_flatten(value, what, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value
    return out


def _check_tree(shapes: dict[str, tuple], config: LlamaConfig, where: str) -> None:
    """Raises ValueError naming the first missing, unexpected or mis-shaped parameter (`shapes` is flat)."""
    expected = _flatten(param_shapes(config), "param_shapes")
    summary = (f"a Llama model with {config.num_layers} layers, hidden {config.hidden_size}, "
               f"tie_word_embeddings={config.tie_word_embeddings}")
    for name, shape in expected.items():
        if name not in shapes:
            raise ValueError(f"missing parameter {name} (shape {shape}) in {where}, expected for {summary}")
    unexpected = [name for name in shapes if name not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"unexpected parameter {unexpected[0]}{more} in {where}: not a parameter of {summary}")
    wrong = [name for name, shape in expected.items() if shapes[name] != shape]
    if wrong:
        name = wrong[0]
        more = f" (and {len(wrong) - 1} more mis-shaped)" if len(wrong) > 1 else ""
        raise ValueError(f"parameter {name} in {where} has shape {shapes[name]}, but the config expects "
                         f"{expected[name]}{more}")


def _write_json(file: str, data: dict) -> None:
    """Writes `data` to `file` atomically (a reader never sees half a file)."""
    tmp = file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, file)
