"""Token augmentation of distillation batches (comera_fx.pretrained.augment): each edit does what it says, the
batches stay well-formed, and nothing outside its own generator is touched."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_fx.pretrained.augment import Augmentation, augment_batch, augment_rows, augmented

NONE = dict(batch_fraction=1.0, span=0.0, mix=0.0, shuffle=0.0, drop=0.0)
rows_strategy = st.lists(
    st.lists(st.integers(1000, 1100), min_size=0, max_size=12).map(lambda b: [101, *b, 102]), min_size=1, max_size=5
)


def is_contiguous_run(part: list[int], whole: list[int]) -> bool:
    return any(whole[i : i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def is_subsequence(part: list[int], whole: list[int]) -> bool:
    it = iter(whole)
    return all(token in it for token in part)


@given(rows_strategy, st.integers(0, 2**16))
def test_every_edit_keeps_the_ends_and_draws_only_from_the_batch(rows, seed):
    for edit in ("span", "mix", "shuffle", "drop"):
        spec = Augmentation(**{**NONE, edit: 1.0})
        out = augment_rows(rows, spec, random.Random(seed))
        assert len(out) == len(rows)
        for i, (before, after) in enumerate(zip(rows, out)):
            assert after[0] == before[0] and after[-1] == before[-1], edit
            body, new = before[1:-1], after[1:-1]
            if len(before) < 3:
                assert after == before
            elif edit == "span":
                assert new and is_contiguous_run(new, body) and len(new) >= round(0.25 * len(body))
            elif edit == "shuffle":
                assert Counter(new) == Counter(body)
            elif edit == "drop":
                assert new and is_subsequence(new, body)
            elif edit == "mix":  # its own body, then a run of another row's body
                assert new[: len(body)] == body
                tail = new[len(body) :]
                others = [r[1:-1] for j, r in enumerate(rows) if j != i]
                assert not others or any(is_contiguous_run(tail, o) for o in others)


def test_no_edit_leaves_rows_alone():
    rows = [[101, 5, 6, 7, 102], [101, 8, 102]]
    assert augment_rows(rows, Augmentation(**NONE), random.Random(0)) == rows


def batch_of(rows: list[list[int]], pad: int = 0) -> dict:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def test_max_growth_bounds_the_width():
    rows = [[101, *range(1000, 1010), 102], [101, *range(2000, 2010), 102]]
    splice = Augmentation(**{**NONE, "mix": 1.0})
    for growth, bound in ((1.0, 12), (2.0, 22)):  # 10 body tokens + another row's run of up to 10, plus the ends
        widths = [
            augment_batch(batch_of(rows), replace(splice, max_growth=growth), random.Random(seed))["input_ids"].shape[1]
            for seed in range(30)
        ]
        assert max(widths) <= int(growth * 12) and max(widths) == min(bound, int(growth * 12))


def test_augmented_batches_are_right_padded_and_trimmed():
    rows = [[101, *range(1000, 1020), 102], [101, 1000, 1001, 102], [101, 102]]
    spec = Augmentation(batch_fraction=1.0, span=1.0, mix=1.0, shuffle=1.0, drop=1.0)
    for seed in range(20):
        out = augment_batch(batch_of(rows), spec, random.Random(seed), pad_id=0)
        mask, ids = out["attention_mask"], out["input_ids"]
        lengths = mask.sum(1)
        assert int(lengths.max()) == ids.shape[1] <= 22  # trimmed to the longest row, never wider than given
        for r in range(len(rows)):
            n = int(lengths[r])
            assert mask[r, :n].eq(1).all() and mask[r, n:].eq(0).all() and ids[r, n:].eq(0).all()
            assert ids[r, 0] == 101 and ids[r, n - 1] == 102
        assert out["token_type_ids"].shape == ids.shape and not out["token_type_ids"].any()


def test_source_seed_and_global_rngs():
    rows = [[101, *range(1000, 1010), 102], [101, *range(2000, 2006), 102]]
    batches = [batch_of(rows)]
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    first = [augmented(batches, seed=3)() for _ in range(1)]
    draw = augmented(batches, seed=3)
    again = [draw() for _ in range(1)]
    assert torch.equal(first[0]["input_ids"], again[0]["input_ids"])
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    # an iterable is cycled over; batch_fraction 0 hands the batches out unchanged
    plain = augmented(batches, Augmentation(batch_fraction=0.0))
    for _ in range(3):
        assert plain() is batches[0]
    calls = []
    from_callable = augmented(lambda: calls.append(1) or batches[0], Augmentation(batch_fraction=0.0))
    from_callable()
    assert calls == [1]


def test_bad_batches_and_settings_are_refused():
    with pytest.raises(ValueError, match="empty or used-up"):
        augmented([])()
    with pytest.raises(ValueError, match="input_ids"):
        augmented([torch.zeros(2, 3)])()
    left_padded = {"input_ids": torch.tensor([[0, 101, 102]]), "attention_mask": torch.tensor([[0, 1, 1]])}
    with pytest.raises(ValueError, match="right-padded"):
        augmented([left_padded])()
    with pytest.raises(ValueError, match="cannot edit batch keys"):
        augment_batch({**batch_of([[101, 5, 102]]), "labels": torch.zeros(1)}, Augmentation(), random.Random(0))
    with pytest.raises(ValueError, match="probability"):
        Augmentation(drop_rate=1.5)
    with pytest.raises(ValueError, match="min_span"):
        Augmentation(min_span=0.0)
    with pytest.raises(ValueError, match="max_growth"):
        Augmentation(max_growth=0.5)
    with pytest.raises(ValueError, match="augment must be"):
        augmented([batch_of([[101, 5, 102]])], spec=True)
