"""The pipeline queue the executor, the simulator and the scheduler tests share (plain Python, no jax)."""
import pytest

from mnemojax.scheduling.pipeline import Pipeline


def test_one_stage_gives_back_what_entered_in_the_same_step():
    p = Pipeline(1)
    assert p.push("a", lambda: "pad") == "a" and list(p) == ["a"]
    assert p.pop() == "a" and len(p) == 0
    assert p.push("b", lambda: "pad") == "b" and p.pop() == "b"


def test_a_micro_batch_leaves_num_stages_steps_after_it_entered():
    """3 stages: while it fills, padding stands in the stages nothing has reached; item i leaves in step i + 2
    (counting from 0), and stage s holds the item that entered s steps ago."""
    p = Pipeline(3)
    left = []
    for step, item in enumerate("abcde"):
        last = p.push(item, lambda: "-")
        assert len(p) == 3
        left.append(p.pop())
        assert last == left[-1] and len(p) == 2
        if step == 1:
            assert list(p) == ["b", "a"]  # newest first: stage 0 holds b, stage 1 holds a
    assert left == ["-", "-", "a", "b", "c"]
    assert list(p) == ["e", "d"]


def test_padding_is_made_only_for_empty_stages():
    made = []

    def padding():
        made.append(1)
        return None

    p = Pipeline(4)
    for item in range(6):
        p.push(item, padding)
        p.pop()
    assert len(made) == 3  # the first push fills stages 1..3; afterwards every stage holds a real item


def test_copy_is_independent_of_the_original():
    p = Pipeline(2)
    p.push("a", lambda: "-")
    p.pop()
    saved = p.copy()
    p.push("b", lambda: "-")
    assert p.pop() == "a" and list(p) == ["b"]
    assert list(saved) == ["a"] and saved.num_stages == 2


def test_misuse_raises():
    with pytest.raises(ValueError, match="num_stages must be a positive integer"):
        Pipeline(0)
    p = Pipeline(2)
    with pytest.raises(RuntimeError, match="not full"):
        p.pop()
    p.push("a", lambda: "-")
    with pytest.raises(RuntimeError, match="push before"):
        p.push("b", lambda: "-")  # the micro-batch in the last stage must leave first
