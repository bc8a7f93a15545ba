"""Llama-3 parameters: a Flax NNX module that owns them, and the plain pytree the step function reads.

Layer weights are stacked over layers ([L, ...]: the module's, the checkpoints' and the sharding table's layout,
`spp` splitting L into stages); the step reads them per layer, each a buffer of its own (`split_layers`), since a
loop over stacked weights makes XLA copy every layer's slice each step.
Letters: L layers, D hidden, H heads, K kv heads, Dh head dim, F MLP width, V vocab (here; elsewhere N heads, H
head dim).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LlamaConfig


def param_shapes(config: LlamaConfig) -> dict:
    """Shapes of the parameter pytree, the same structure as `LlamaParams.pure()`."""
    c = config
    L, D, H, K, Dh, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            c.intermediate_size, c.vocab_size)
    shapes = {
        "embed": (V, D),
        "layers": {
            "attn_norm": (L, D),
            "wq": (L, D, H, Dh),
            "wk": (L, D, K, Dh),
            "wv": (L, D, K, Dh),
            "wo": (L, H, Dh, D),
            "mlp_norm": (L, D),
            "w_gate": (L, D, F),
            "w_up": (L, D, F),
            "w_down": (L, F, D),
        },
        "final_norm": (D,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


class LlamaParams(nnx.Module):
    """All weights of a Llama-3 model, randomly initialised (normal, std `init_std`; norms 1).

    The step function does not call this module: it reads `pure()`, a plain dict, inside `jax.jit`.
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, init_std: float = 0.02, rngs: nnx.Rngs):
        shapes = param_shapes(config)

        def normal(shape):
            return nnx.Param((init_std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))

        def ones(shape):
            return nnx.Param(jnp.ones(shape, dtype))

        self.embed = normal(shapes["embed"])
        self.layers = nnx.Dict({
            name: (ones(shape) if name.endswith("norm") else normal(shape))
            for name, shape in shapes["layers"].items()
        })
        self.final_norm = ones(shapes["final_norm"])
        if "lm_head" in shapes:
            self.lm_head = normal(shapes["lm_head"])

    def pure(self) -> dict:
        """The parameters as a plain nested dict of arrays (the structure of `param_shapes`)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))


def init_params(config: LlamaConfig, *, dtype=jnp.float32, seed: int = 0, init_std: float = 0.02,
                shardings=None) -> dict:
    """Random parameters, created directly on `shardings` (a pytree like `param_shapes`) when given."""

    def make():
        return LlamaParams(config, dtype=dtype, init_std=init_std, rngs=nnx.Rngs(seed)).pure()

    return jax.jit(make, out_shardings=shardings)()


def mesh_layout(config: LlamaConfig, *, tp: int, spp: int) -> tuple[int, int]:
    """(layers, kv heads) of the parameters on a (tp, spp) mesh: `LlamaConfig.mesh_layout`."""
    return config.mesh_layout(tp=tp, spp=spp)


def to_mesh_layout(params: dict, config: LlamaConfig, *, tp: int, spp: int, shardings) -> dict:
    """The canonical parameters (`param_shapes`) in the mesh layout of `mesh_layout`, on `shardings`."""
    num_layers, kv_heads = mesh_layout(config, tp=tp, spp=spp)
    pad = num_layers - config.num_layers
    rep = kv_heads // config.num_kv_heads

    def layout(p):
        layers = dict(p["layers"])
        if rep > 1:
            for name in ("wk", "wv"):
                layers[name] = jnp.repeat(layers[name], rep, axis=2)
        if pad:
            layers = {k: jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)) for k, v in layers.items()}
        return {**p, "layers": layers}

    if not pad and rep == 1:
        return jax.device_put(params, shardings)
    return jax.jit(layout, out_shardings=shardings)(params)


def split_layers(params: dict, spp: int) -> dict:
    """The step layout: `layers` as a list with one dict per layer each pipeline stage holds, every leaf
    [spp, ...] (stage s's i-th layer at [s]) sharded over `spp` on its first axis, so that inside the step each
    layer's weights are a buffer of their own. From the stacked layout ([L, ...], split over `spp` on L): a layer
    loop over stacked weights slices them, and XLA copies every slice once a step (7 copies a layer, seen in the
    compiled step and in GPU traces). Consumes `params["layers"]`: each stacked weight is deleted once split, one
    name at a time, so the peak is the weights plus one name's (the caller must not use those arrays after).
    """
    per_name = {}
    for name, a in sorted(params["layers"].items()):
        local = a.shape[0] // spp
        per_name[name] = jax.jit(lambda x: tuple(x.reshape(spp, local, *x.shape[1:])[:, i] for i in range(local)),
                                 out_shardings=(_layer_sharding(a.sharding),) * local)(a)
        a.delete()  # a reference kept by the caller's dict would hold it until the end
    num = len(next(iter(per_name.values())))
    return {**params, "layers": [{n: v[i] for n, v in per_name.items()} for i in range(num)]}


def _layer_sharding(stacked):
    """The sharding of one layer's [spp, ...] weight split from a stacked [L, ...] one sharded `stacked`."""
    from jax.sharding import NamedSharding, PartitionSpec

    spec = stacked.spec
    return NamedSharding(stacked.mesh, PartitionSpec(spec[0] if spec else None, *spec[1:]))


def abstract_step_params(config: LlamaConfig, *, dtype, tp: int, spp: int, shardings) -> dict:
    """What `split_layers` gives for the parameters of `config` in the mesh layout (`to_mesh_layout`) on
    `shardings` (the stacked layout's, as there), as `jax.ShapeDtypeStruct`s: the step's parameters to lower or
    compile it without making any (`Executor.lower_shape`, `mnemojax.bench.aot_step`)."""
    num_layers, kv_heads = mesh_layout(config, tp=tp, spp=spp)
    shapes = param_shapes(dataclasses.replace(config, num_layers=num_layers, num_kv_heads=kv_heads))
    params = {k: jax.ShapeDtypeStruct(v, dtype, sharding=shardings[k]) for k, v in shapes.items() if k != "layers"}
    layer = {n: jax.ShapeDtypeStruct((spp, *v[1:]), dtype, sharding=_layer_sharding(shardings["layers"][n]))
             for n, v in shapes["layers"].items()}
    return {**params, "layers": [layer] * (num_layers // spp)}


def stack_layers(params: dict) -> dict:
    """The stacked layout ([L, ...], split over `spp` on L) of step-layout parameters (`split_layers`): the mesh
    layout, not the checkpoint's where they differ (zero layers padding L to a multiple of spp, KV heads repeated
    up to tp), which `save_params` refuses, naming the shape."""
    from jax.sharding import NamedSharding

    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    stacked = {}
    for name in layers[0]:
        first = layers[0][name]
        spp = first.shape[0]
        out = NamedSharding(first.sharding.mesh, first.sharding.spec)
        stacked[name] = jax.jit(
            lambda *xs: jnp.stack(xs, axis=1).reshape(spp * len(xs), *xs[0].shape[1:]),
            out_shardings=out)(*(layer[name] for layer in layers))
    return {**params, "layers": stacked}
