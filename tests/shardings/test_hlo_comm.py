"""Communication of the compiled step, read from its optimized HLO (helpers of scripts/hlo_comm.py).

Medha's claim for KV parallelism: the merge moves data proportional to the number of query tokens, never to
the context length. Checked on the real engine step: the KVP collectives of a decode (and of a prefill chunk)
at a 512-token context and at an 8192-token context, where the page table is 16x wider, are the same
collectives of the same sizes; doubling the step's token rows doubles them.
"""

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardings.mesh import KVP, SPP, TP, make_mesh

from mnemojax.bench import hlo_comm

LENS = (512, 8192)
CHUNK = 32  # prefill chunk rows; a decode step is bucketed to 16 rows


@pytest.fixture(scope="module")
def steps():
    """{(max_model_len, "decode" | "prefill"): (llm, plan, StepComm)} on the (kvp, spp, tp) = (2, 1, 2)
    mesh, for one request filling the context to max_model_len - 32 tokens over both KVP ranks."""
    out = {}
    for n in LENS:
        llm = hlo_comm.make_engine(2, 1, 2, n, chunk_size=CHUNK)
        for kind, plan in hlo_comm.step_plans(llm, context=n - CHUNK).items():
            out[(n, kind)] = llm, plan, hlo_comm.step_comm(llm, plan)
    return out


@pytest.mark.slow  # the module's engines (two context lengths on a 2x1x2 mesh) took 55 s on 2 cores cold
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kvp_collectives_are_the_same_at_very_different_context_lengths(steps, kind):
    (short_llm, short_plan, short), (long_llm, long_plan, long) = steps[(LENS[0], kind)], steps[(LENS[1], kind)]
    short, long = short.collectives, long.collectives
    # Not vacuous: the contexts really differ, the page tables are 16x wider, the request spans both ranks.
    for plan, n in ((short_plan, LENS[0]), (long_plan, LENS[1])):
        (chunk,) = plan.chunks
        assert chunk.request.kv_ranks == [0, 1]
        assert chunk.start + chunk.num_tokens > n - 2 * CHUNK
    ex_s, ex_l = short_llm.engine.executor, long_llm.engine.executor
    assert ex_l.max_pages_per_seq == 16 * ex_s.max_pages_per_seq
    kvp_short, kvp_long = hlo_comm.axis_multiset(short, KVP), hlo_comm.axis_multiset(long, KVP)
    assert sum(kvp_short.values()) >= 2, short  # the merge's max and sums are there
    assert {k for k, _, _ in kvp_short} == {"all-reduce"}
    assert kvp_short == kvp_long
    # Nothing else grows with the context either, and every collective runs a known number of times.
    assert hlo_comm.bytes_by_axis(short) == hlo_comm.bytes_by_axis(long)
    assert all(c.count is not None for c in short + long)


@pytest.mark.slow  # the engines above
def test_kvp_bytes_follow_the_query_rows_not_the_context(steps):
    for n in LENS:
        llm, _, decode = steps[(n, "decode")]
        _, _, prefill = steps[(n, "prefill")]
        t_dec, t_pre = decode.T, prefill.T
        assert (t_dec, t_pre) == (16, 32)
        # Besides the layers' merges, each step exchanges its sampled tokens over the KVP ranks once (async
        # scheduling reads them on the device): kvp x R int32, whatever the context. (Told apart by its int32
        # operand: op names can come from a compilation cache entry of an equal program.)
        tokens = {s.R: f"s32[2,{s.R}]" for s in (decode, prefill)}
        for step in (decode, prefill):
            exchange = [c for c in step.collectives if tokens[step.R] in c.shapes]
            assert [(c.axis, c.step_bytes, c.loop_depth) for c in exchange] == [(KVP, 2 * step.R * 4, 0)]
        decode, prefill = ([c for c in s.collectives if tokens[s.R] not in c.shapes] for s in (decode, prefill))
        dec, pre = hlo_comm.bytes_by_axis(decode), hlo_comm.bytes_by_axis(prefill)
        assert pre[KVP] == 2 * dec[KVP] > 0
        assert pre[TP] == 2 * dec[TP] > 0
        # Medha's formula: layers x T x (N / tp) x (H + 2) x 4 bytes (partial outputs, max and denominator).
        assert dec[KVP] == hlo_comm.medha_bytes(llm, t_dec)[KVP]
        assert dec[TP] == hlo_comm.medha_bytes(llm, t_dec)[TP]
        assert pre[KVP] == hlo_comm.medha_bytes(llm, t_pre)[KVP]
        # The layers are unrolled (each reads its own weights): every KVP collective runs once, outside any
        # loop, and each layer has the same ones.
        layers = llm.engine.model_config.num_layers
        kvp_colls = [c for c in decode if c.axis == KVP]
        assert {(c.loop_depth, c.count) for c in kvp_colls} == {(0, 1)}
        assert len(kvp_colls) % layers == 0 and len(kvp_colls) >= layers


def test_collectives_are_attributed_to_mesh_axes_through_a_permuted_device_order():
    """A mesh over the devices in a scrambled order: replica groups are logical ids of the program's device
    assignment, which must be mapped back to mesh coordinates, not read as device ids."""
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    mesh = make_mesh(2, 2, 2, devices=[jax.devices()[i] for i in perm])

    def f(x):
        def layer(c, _):
            return c + lax.psum(c * 2.0, KVP), None
        y, _ = lax.scan(layer, x, None, length=3)  # 3 kvp all-reduces of f32[4, 8] per run
        y = lax.ppermute(y, SPP, perm=[(0, 1), (1, 0)])
        g = lax.all_gather(y, TP, tiled=True)  # operand f32[4, 8], result f32[8, 8]
        return lax.psum(g, (KVP, TP))

    spec = P(KVP, SPP, TP)
    fn = jax.jit(jax.shard_map(lambda a: f(a[0, 0, 0])[None, None, None], mesh=mesh, in_specs=spec,
                               out_specs=P(None, SPP)))
    x = jax.device_put(np.ones((2, 2, 2, 4, 8), np.float32), NamedSharding(mesh, spec))
    compiled = fn.lower(x).compile()
    colls = hlo_comm.find_collectives(compiled.as_text(), mesh, compiled.runtime_executable().local_devices())
    got = sorted((c.kind, c.axis, c.group_size, c.bytes, c.count) for c in colls)
    assert got == sorted([
        ("all-reduce", "kvp", 2, 4 * 8 * 4, 3),
        ("collective-permute", "spp", 2, 4 * 8 * 4, 1),
        ("all-gather", "tp", 2, 4 * 8 * 4, 1),
        ("all-reduce", "kvp+tp", 4, 8 * 8 * 4, 1),
    ]), got
    # The mesh's own flat order is the program's device assignment.
    assert [d.id for d in compiled.runtime_executable().local_devices()] == [d.id for d in mesh.devices.flat]


def test_replica_group_formats():
    assert hlo_comm.replica_groups("replica_groups={{0,4},{1,5}}, x=1") == [[0, 4], [1, 5]]
    assert hlo_comm.replica_groups("replica_groups=[2,2]<=[4]") == [[0, 1], [2, 3]]
    assert hlo_comm.replica_groups("replica_groups=[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    assert hlo_comm.replica_groups("source_target_pairs={{0,2},{1,3}}, m") == [[0, 2], [1, 3]]
    assert hlo_comm.replica_groups("replica_groups={}, to_apply=%add") is None  # every device
    # jax 0.11's compiled HLO names mesh axes; ids are the mesh's in row-major order (kvp, spp, tp): 4k + 2s + t.
    mesh = "replica_groups=mesh['kvp'=2,'spp'=2,'tp'=2] "
    assert hlo_comm.replica_groups(mesh + "{'kvp'}, use_global_device_ids=true") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo_comm.replica_groups(mesh + "{'tp'}, dimensions={0}") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hlo_comm.replica_groups(mesh + "{'kvp','tp'}, x") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert hlo_comm.replica_groups(mesh + "{}, x") == [[i] for i in range(8)]
    # a sub-axis: x (4) = 2 (pre) x 2 (the group's part); ids 2x + y
    assert hlo_comm.replica_groups("replica_groups=mesh['x'=4,'y'=2] {'x':(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # the devices in another order than the mesh's: the mesh holds ids [[3, 1], [2, 0]]
    assert hlo_comm.replica_groups("replica_groups=@mesh<'a'=2,'b'=2>(3,1,2,0) {'a'}") == [[3, 2], [1, 0]]
    assert hlo_comm.replica_groups("replica_groups=@mesh<'a'=2,'b'=2>([2,2]<=[2,2]T(1,0)) {'b'}") == [[0, 2], [1, 3]]
    assert hlo_comm.shape_bytes("(f32[16,4,16]{2,1,0}, /*index=1*/bf16[16,4]{1,0}, s32[])") == 4096 + 128 + 4
