"""Page tables kept on the device (issue 12, item 4): each running request holds a slot (a row of the device's
page table) per KVP rank, and a step sends only the entries that changed. The rows must hold exactly each
request's pages; a decode that stays in its last page sends nothing; slots are reused only when free; results
do not depend on which slot a request got."""
import jax
import numpy as np
import pytest

from mnemojax import LLM, SamplingParams
from mnemojax.scheduling.request import RequestStatus
from tests.hf_utils import make_hf_checkpoint

GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("table") / "m", weight_scale=8.0, seed=4, num_layers=2,
                              num_heads=4, num_kv_heads=2, hidden_size=32, intermediate_size=64,
                              max_position_embeddings=512)


def _llm(ckpt, **kw):
    kw = {"page_size": 4, "chunk_size": 16, "max_model_len": 128, **kw}
    return LLM(model=ckpt, **kw)


def _check_rows(ex):
    """Every running request's device row on each of its ranks holds its pages, in order."""
    table = np.asarray(jax.device_get(ex.page_table))
    checked = 0
    for rank, slots in enumerate(ex._slots):
        for b, req in enumerate(slots.owner):
            if req is None or req.status is not RequestStatus.RUNNING or rank not in req.kv_ranks:
                continue
            pages = req.pages[req.kv_ranks.index(rank)]
            assert table[rank, b, :len(pages)].tolist() == list(pages), (rank, b, req.request_id)
            checked += 1
    return checked


def test_device_rows_hold_each_requests_pages_and_decodes_send_only_new_pages(ckpt):
    llm = _llm(ckpt, async_scheduling=False)
    e, ex = llm.engine, llm.engine.executor
    sent = []
    apply = ex.apply_table_updates

    def spy(updates, broadcast=True):
        sent.append(int((updates[:, 0] < ex.page_table.shape[1] * ex.page_table.shape[2]).sum()))
        apply(updates, broadcast)

    ex.apply_table_updates = spy
    rng = np.random.default_rng(0)
    for n in (6, 21, 35):
        e.add_request(rng.integers(0, 256, n).tolist(), SamplingParams(max_tokens=20, temperature=0,
                                                                        ignore_eos=True))
    entries = []
    while e.has_unfinished():
        before = {r.request_id: sum(map(len, r.pages)) for r in e.scheduler.running}
        calls = len(sent)
        e.step()
        after = {r.request_id: sum(map(len, r.pages)) for r in e.scheduler.running}
        if before and set(after) == set(before) and all(r.output_token_ids for r in e.scheduler.running):
            # a step of decodes in which nobody joined or left: the entries sent are the pages added
            entries.append((sum(after[i] - before[i] for i in after), sum(sent[calls:])))
        if e.scheduler.running:
            assert _check_rows(ex) == len(e.scheduler.running)
    assert entries and all(got == want for want, got in entries)  # entries sent == pages added
    assert any(want == 0 for want, _ in entries)  # steps within the last pages sent nothing


def test_slots_are_reused_and_results_do_not_depend_on_the_slot(ckpt):
    """Two slots, six requests one after another and two at a time: slots change hands (rows sent whole), and
    each request gets what it gets alone in a fresh engine."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 5, 19, 44, 8, 13)]
    alone = [_llm(ckpt, max_num_seqs=1).generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts[:2]]
    llm = _llm(ckpt, max_num_seqs=2)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs[:2] == alone
    one = _llm(ckpt, max_num_seqs=2)
    assert outs == [one.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert len(llm.engine.executor._slots[0].owner) == 2


def test_no_free_slot_raises_rather_than_overwriting(ckpt):
    llm = _llm(ckpt, max_num_seqs=2)
    ex = llm.engine.executor
    e = llm.engine
    for first in (0, 100):  # different prompts: neither waits for the other's pages (prefix caching)
        e.add_request(list(range(first, first + 10)), GREEDY)
    e.step()
    held = ex._slots[0]
    assert len(held.of) == 2 and not held.free
    with pytest.raises(RuntimeError, match="sequence slots"):
        ex._free_slot(0)  # both holders are running: neither slot may be taken
