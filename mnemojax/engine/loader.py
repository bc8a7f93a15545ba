"""Loading, separated from running: resolves an `EngineConfig` into the parts an engine runs on.

`load(config)` does everything that reads files or touches devices before the first step: the model's
configuration (a preset or a checkpoint's `config.json`), the device mesh, the weights (random for presets, a
Hugging Face directory, or an Orbax checkpoint) laid out on the mesh, the tokenizer, and the KV cache's size.
`LLMEngine(config, loaded)` then only wires them to an executor, a KV page manager, a predictor and a scheduler.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from models import checkpoint, orbax_io
from models.attention import resolve_for_model
from models.config import PRESETS, LlamaConfig, preset
from models.kernels import AUTO
from models.llama import ModelSpec
from models.params import init_params, mesh_layout, split_layers, to_mesh_layout
from models.tokenizer import load_tokenizer
from shardings.mesh import make_mesh
from shardings.specs import ShardingTable

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What `load` resolved: everything an engine needs that came from files or devices."""

    model_config: LlamaConfig
    max_model_len: int  # prompt + generated tokens of one request
    mesh: jax.sharding.Mesh
    table: ShardingTable
    spec: ModelSpec
    params: dict  # in the mesh layout, on the mesh, layers split (`models.params.split_layers`)
    tokenizer: object | None  # None: token-id prompts only
    num_pages: int  # KV pages per device (page 0 reserved)


def use_compilation_cache(path: str) -> str | None:
    """Points JAX's persistent compilation cache at `path` (`~` expanded; empty: none) unless one is already set;
    returns the directory in use."""
    current = jax.config.jax_compilation_cache_dir
    if current or not path:
        return current or None
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def load(config) -> LoadedModel:
    """Resolves model, mesh, weights, tokenizer and KV sizing of an `EngineConfig`."""
    use_compilation_cache(config.compilation_cache_dir)
    is_preset = config.model in PRESETS
    mc = preset(config.model) if is_preset else LlamaConfig.from_pretrained(config.model)
    config = with_dtype(config)
    max_model_len = config.max_model_len or min(mc.max_position_embeddings, 8192)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({mc.max_position_embeddings})")
    mesh = make_mesh(config.kvp, config.spp, config.tp)
    table = ShardingTable()
    num_layers, kv_heads = mesh_layout(mc, tp=config.tp, spp=config.spp)

    def named(specs):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

    # Load the checkpoint layout sharded as far as it divides, then pad / repeat into the mesh layout.
    canonical = named(table.params(mc.tie_word_embeddings, split_layers=num_layers == mc.num_layers,
                                   split_kv_heads=kv_heads == mc.num_kv_heads))
    dtype = jnp.dtype(config.dtype)
    if is_preset:
        params = init_params(mc, dtype=dtype, seed=config.seed, shardings=canonical)
    elif orbax_io.is_orbax_checkpoint(config.model):
        params = orbax_io.restore_params(config.model, mc, dtype, canonical)
    else:
        params = checkpoint.load_hf_params(config.model, mc, dtype, canonical)
    params = to_mesh_layout(params, mc, tp=config.tp, spp=config.spp,
                            shardings=named(table.params(mc.tie_word_embeddings)))
    params = split_layers(params, config.spp)  # each layer's weights a buffer of their own
    if config.kv_memory_fraction is not None:
        num_pages = _pages_from_memory(config, mc, mesh)
    else:
        num_pages = config.num_pages or 1 + 4 * -(-max_model_len // config.page_size)
    tokenizer = load_tokenizer(config.model) if (config.model == "tiny" or not is_preset) else None
    attention = engine_attention(config, mc)
    logger.info("attention: %s%s", attention, " (auto)" if attention != config.attention else "")
    spec = ModelSpec(mc, config.dtype, config.block_pages, attention)
    return LoadedModel(mc, max_model_len, mesh, table, spec, params, tokenizer, num_pages)


def model_dtype(model: str) -> str:
    """What dtype `auto` computes a model in: the dtype its weights are stored in (an Orbax checkpoint's marker, a
    safetensors checkpoint's tensors; float32 where they differ), float32 for a float16 one (mnemojax computes in
    float32 or bfloat16, and float32 holds every float16 value exactly) and for presets (random weights)."""
    if model in PRESETS:
        return "float32"
    stored = orbax_io.read_marker(model)["dtype"] if orbax_io.is_orbax_checkpoint(model) else \
        checkpoint.stored_dtype(model)
    if stored == "float16":
        logger.info("dtype auto: %s is stored in float16, computed in float32 (which holds it exactly)", model)
        return "float32"
    return stored


def with_dtype(config):
    """`config` with dtype `auto` resolved (`model_dtype`); itself otherwise."""
    return dataclasses.replace(config, dtype=model_dtype(config.model)) if config.dtype == AUTO else config


def engine_attention(config, mc: LlamaConfig) -> str:
    """The attention implementation the engine runs for `config.attention` and this model: `auto` resolved
    against the model (`models.attention.resolve_for_model`: on a Hopper GPU the Mosaic kernels when they support
    its dtype, heads, head dim and the page size; else the Pallas kernels on an NVIDIA GPU; else the reference).
    The loader's ModelSpec and the predictor's cost model both take it from here."""
    return resolve_for_model(config.attention, mc, with_dtype(config).dtype, config.page_size)


def _pages_from_memory(config, mc: LlamaConfig, mesh) -> int:
    """KV pages per device filling `kv_memory_fraction` of the memory the weights left free."""
    free = []
    for d in mesh.devices.flat:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            raise ValueError(f"kv_memory_fraction needs a device that reports its memory; {d.device_kind} does "
                             "not: give num_pages instead")
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    page_bytes = mc.kv_page_bytes(page_size=config.page_size, tp=config.tp, spp=config.spp,
                                  dtype_bytes=jnp.dtype(config.dtype).itemsize)
    pages = int(config.kv_memory_fraction * min(free) // page_bytes)
    if pages < 2:
        raise ValueError(f"kv_memory_fraction {config.kv_memory_fraction} leaves room for {pages} KV pages of "
                         f"{page_bytes} bytes per device; at least 2 are needed")
    logger.info("KV cache: %d pages of %d tokens per device (%.2f GiB)", pages, config.page_size,
                pages * page_bytes / 2**30)
    return pages
