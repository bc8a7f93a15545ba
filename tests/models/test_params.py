"""The step's weight layout: `split_layers` gives each layer's weights a buffer of their own, consuming the stacked
ones as it goes (the load's peak is the weights plus one name's, not twice the layers)."""
import gc

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from models.config import preset
from models.params import init_params, split_layers, to_mesh_layout
from shardings.mesh import make_mesh
from shardings.specs import ShardingTable


def test_split_layers_gives_each_stages_layers_and_frees_the_stacked_weights():
    c, spp = preset("tiny"), 2
    mesh = make_mesh(1, spp, 1)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), ShardingTable().params(c.tie_word_embeddings))
    params = to_mesh_layout(init_params(c, dtype=jnp.float32, shardings=shardings), c, tp=1, spp=spp,
                            shardings=shardings)
    stacked = {n: np.asarray(a) for n, a in params["layers"].items()}
    gc.collect()  # arrays other tests left unreachable
    before = sum(a.nbytes for a in jax.live_arrays())
    out = split_layers(params, spp)
    local = c.num_layers // spp
    assert len(out["layers"]) == local
    for name, want in stacked.items():
        for i in range(local):  # stage s's i-th layer is stacked layer s * local + i
            np.testing.assert_array_equal(np.asarray(out["layers"][i][name]), want[[i, local + i]])
    assert all(a.is_deleted() for a in params["layers"].values())
    gc.collect()
    assert sum(a.nbytes for a in jax.live_arrays()) == before  # the same bytes, now per layer
