"""The collectives of `shardings.collectives`, run inside `jax.shard_map` on meshes from `make_mesh`, against the
same computation without sharding (numpy, float64)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.attention import dense_attention_reference
from shardings.collectives import NEG, from_last_stage, kvp_merge, pipeline_shift
from shardings.mesh import KVP, SPP, TP, make_mesh

N, K, H = 4, 2, 8  # query heads, kv heads (GQA), head dim


def _put(mesh, spec, *arrays):
    return [jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec)) for a in arrays]


def _np_attention(q, k, v, q_pos, k_pos):
    """Softmax attention in float64, causal on absolute positions; a row with no visible key gives 0."""
    T = q.shape[0]
    qg = q.astype(np.float64).reshape(T, K, N // K, H) * H ** -0.5
    s = np.einsum("tkgh,ckh->tkgc", qg, k.astype(np.float64))
    mask = (k_pos[None, :] <= q_pos[:, None])[:, None, None, :]
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    p = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1)
    out = np.einsum("tkgc,ckh->tkgh", p, v.astype(np.float64)) / np.where(den == 0, 1.0, den)[..., None]
    return out.reshape(T, N, H)


def _shard_partials(q, k, v, q_pos, k_pos, bounds):
    """Each rank's (out, lse) over its contiguous key range, by `dense_attention_reference`; a row that sees
    no key of the shard gets the attention contract's (0, NEG)."""
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out, lse = dense_attention_reference(jnp.asarray(q), jnp.asarray(k[lo:hi]), jnp.asarray(v[lo:hi]),
                                             jnp.asarray(q_pos), jnp.asarray(k_pos[lo:hi]))
        out, lse = np.asarray(out), np.asarray(lse)
        empty = ~np.isfinite(lse)  # -inf (or NaN from an empty softmax) for a row with no visible key
        outs.append(np.where(empty[..., None], 0.0, out).astype(np.float32))
        lses.append(np.where(empty, NEG, lse).astype(np.float32))
    return np.stack(outs), np.stack(lses)


@functools.cache
def _merge_fn(kvp):
    mesh = make_mesh(kvp=kvp)
    f = jax.shard_map(lambda o, l, s: kvp_merge(o[0], l[0], s[0])[None], mesh=mesh,
                      in_specs=(P(KVP), P(KVP), P(KVP)), out_specs=P(KVP))
    return mesh, jax.jit(f)


@pytest.mark.parametrize("kvp", [2, 4, 8])
def test_kvp_merge_matches_attention_over_the_union_of_shards(kvp):
    """Each row is shared on a subset of ranks (all, some, one, none); on those ranks the merge equals softmax
    attention over the keys of exactly those ranks' shards, and every other rank keeps its own partial result.

    Some ranks see no key for some rows (early query positions, an empty shard): lse = NEG, weight 0."""
    rng = np.random.default_rng(kvp)
    C = 13 * kvp  # keys in all
    sizes = rng.multinomial(C - kvp, np.ones(kvp) / kvp) + 1
    if kvp >= 4:
        sizes[1], sizes[2] = 0, sizes[2] + sizes[1]  # a rank that holds no key at all
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    k_pos = np.arange(C)
    k = rng.standard_normal((C, K, H)).astype(np.float32)
    v = rng.standard_normal((C, K, H)).astype(np.float32)
    # Query rows: a decode at the end of the context, tokens mid-context, one that sees only the first key,
    # one that sees no key at all (a shared row whose every shard is empty), and random ones.
    q_pos = np.concatenate([[C - 1, C // 2, 0, -1], rng.integers(0, C, 12)])
    T = len(q_pos)
    q = (3 * rng.standard_normal((T, N, H))).astype(np.float32)  # peaked softmax: partial maxima differ a lot
    subsets = [list(range(kvp)), list(range(kvp)), list(range(kvp)), list(range(kvp)),
               [], [kvp - 1], [0, kvp - 1]] + [sorted(rng.choice(kvp, rng.integers(0, kvp + 1), replace=False))
                                               for _ in range(T - 7)]
    shared = np.zeros((kvp, T), bool)
    for t, ranks in enumerate(subsets):
        shared[ranks, t] = True

    out, lse = _shard_partials(q, k, v, q_pos, k_pos, bounds)
    assert (lse == NEG).any(), "some rank must see no key for some row"
    mesh, merge = _merge_fn(kvp)
    got = np.asarray(merge(*_put(mesh, P(KVP), out, lse, shared)))

    assert np.isfinite(got).all()
    for t, ranks in enumerate(subsets):
        keys = np.concatenate([np.arange(bounds[r], bounds[r + 1]) for r in ranks] + [np.zeros(0, int)])
        want = _np_attention(q[t:t + 1], k[keys], v[keys], q_pos[t:t + 1], k_pos[keys])[0]
        for r in range(kvp):
            if r in ranks:
                np.testing.assert_allclose(got[r, t], want, rtol=1e-5, atol=1e-6, err_msg=f"row {t} rank {r}")
            else:
                np.testing.assert_array_equal(got[r, t], out[r, t], err_msg=f"unshared row {t} rank {r}")
    # The rows shared on every rank are plain full attention over all keys.
    full = _np_attention(q[:4], k, v, q_pos[:4], k_pos)
    for r in range(kvp):
        np.testing.assert_allclose(got[r, :4], full, rtol=1e-5, atol=1e-6)


def test_kvp_merge_ignores_what_an_unshared_row_holds():
    """A rank that does not hold a shared row's request may use that row for its own request: even a non-finite
    value there (NaN, inf) leaves the merge on the ranks that share the row unchanged."""
    mesh, merge = _merge_fn(4)
    rng = np.random.default_rng(3)
    T = 3
    out = rng.standard_normal((4, T, N, H)).astype(np.float32)
    lse = rng.standard_normal((4, T, N)).astype(np.float32)
    shared = np.zeros((4, T), bool)
    shared[:2] = True  # rows shared on ranks 0 and 1; ranks 2 and 3 use them for their own requests
    clean = np.asarray(merge(*_put(mesh, P(KVP), out, lse, shared)))
    out[2], lse[2] = np.nan, np.nan
    out[3], lse[3] = np.inf, np.inf
    got = np.asarray(merge(*_put(mesh, P(KVP), out, lse, shared)))
    np.testing.assert_array_equal(got[:2], clean[:2])
    assert np.isfinite(got[:2]).all()
    np.testing.assert_array_equal(got[2:], out[2:])  # each keeps its own


def test_kvp_merge_on_a_3d_mesh_merges_over_kvp_only():
    """On the (2, 2, 2) mesh each (spp, tp) position merges its own KVP pair, not its neighbours' data."""
    mesh = make_mesh(2, 2, 2)
    rng = np.random.default_rng(7)
    T = 5
    out = rng.standard_normal((2, 2, 2, T, N, H)).astype(np.float32)
    lse = rng.standard_normal((2, 2, 2, T, N)).astype(np.float32)
    lse[1, :, :, 0] = NEG  # rank 1 sees nothing for row 0
    shared = np.ones((2, 2, 2, T), bool)
    shared[:, :, :, 4] = False
    spec = P(KVP, SPP, TP)
    f = jax.jit(jax.shard_map(lambda o, l, s: kvp_merge(o[0, 0, 0], l[0, 0, 0], s[0, 0, 0])[None, None, None],
                              mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    got = np.asarray(f(*_put(mesh, spec, out, lse, shared)))
    w = np.exp(lse.astype(np.float64) - lse.max(0, keepdims=True))  # weights of the two KVP ranks
    want = (w[..., None] * out).sum(0) / w.sum(0)[..., None]
    for r in range(2):
        np.testing.assert_allclose(got[r, :, :, :4], want[:, :, :4], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[r, :, :, 0], out[0, :, :, 0], rtol=1e-6, atol=0)  # rank 1 weight 0
        np.testing.assert_array_equal(got[r, :, :, 4], out[r, :, :, 4])


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 2, 2), (2, 1, 2)])
def test_pipeline_shift_hands_each_stage_the_previous_stages_block(mesh_shape):
    kvp, spp, tp = mesh_shape
    mesh = make_mesh(kvp, spp, tp)
    x = np.random.default_rng(spp).standard_normal((kvp, spp, 6, 4)).astype(np.float32)
    spec = P(KVP, SPP)  # replicated over tp
    f = jax.jit(jax.shard_map(lambda a: pipeline_shift(a[0, 0])[None, None], mesh=mesh, in_specs=spec,
                              out_specs=spec))
    got = np.asarray(f(*_put(mesh, spec, x)))
    want = np.zeros_like(x)
    want[:, 1:] = x[:, :-1]  # stage s gets stage s-1's block, stage 0 zeros; the last stage's goes nowhere
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 2, 2)])
def test_from_last_stage_gives_every_stage_the_last_stages_value(mesh_shape):
    kvp, spp, tp = mesh_shape
    mesh = make_mesh(kvp, spp, tp)
    x = np.random.default_rng(10 + spp).standard_normal((kvp, spp, 3, 5)).astype(np.float32)
    x[:, :-1] = np.nan  # what earlier stages hold must not leak into the result, not even as NaN
    spec = P(KVP, SPP)
    f = jax.jit(jax.shard_map(lambda a: from_last_stage(a[0, 0])[None, None], mesh=mesh, in_specs=spec,
                              out_specs=spec))
    got = np.asarray(f(*_put(mesh, spec, x)))
    for s in range(spp):
        np.testing.assert_array_equal(got[:, s], x[:, -1])


def test_kvp_merge_refuses_partials_rounded_to_16_bits():
    """A bf16 partial (the Mosaic kernels' own out dtype) would be rounded before the merge, so kvp > 1 differs
    from one device: the merge raises, naming the fix, instead of merging it; one rank has nothing to merge."""
    mesh, merge = _merge_fn(2)
    out = np.zeros((2, 3, N, H), np.float32)
    lse = np.zeros((2, 3, N), np.float32)
    shared = np.ones((2, 3), bool)
    o16, l32, s = _put(mesh, P(KVP), out.astype(jnp.bfloat16), lse, shared)
    with pytest.raises(ValueError, match="kvp_merge needs float32 partials .*out_dtype=float32.*bfloat16"):
        merge(o16, l32, s)
    mesh1, one = _merge_fn(1)
    o16 = np.ones((1, 3, N, H), jnp.bfloat16)
    got = one(*_put(mesh1, P(KVP), o16, np.zeros((1, 3, N), np.float32), np.ones((1, 3), bool)))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), 1.0)
