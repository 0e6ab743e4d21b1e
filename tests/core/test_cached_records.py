"""CachedRecords (core/cached_records.py), the prefix cache's records: read and written as a dict of CachedBlock
(the same answers as a dict, in the same order, for any sequence of stores and pops), token ids of one width in
one array, ``add_new`` all or nothing, reads that own their token ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_server.core import InvariantViolationError
from kvpool_server.core.cached_records import CachedRecords
from kvpool_server.core.kv_event_types import CachedBlock

BS = 4


def entry(k: int, width: int = BS) -> CachedBlock:
    return CachedBlock(bytes([k % 256]) * 32, bytes([(k + 1) % 256]) * 32, np.arange(k, k + width, dtype=np.uint32),
                       b"t%d" % (k % 3), b"x" if k % 2 else b"")


def same(records: CachedRecords, model: dict[int, CachedBlock]) -> None:
    records.check_invariants()
    assert list(records) == list(model) and len(records) == len(model) and bool(records) == bool(model)
    for (key, got), want in zip(records.items(), model.values()):
        assert got.block_hash == want.block_hash and got.parent_hash == want.parent_hash
        assert got.salt == want.salt and got.extra == want.extra and got.token_ids.tolist() == want.token_ids.tolist()
        assert records.hash_of(key) == want.block_hash and key in records
    assert [e.block_hash for e in records.values()] == [e.block_hash for e in model.values()]


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "pop", "pop_hash", "add", "evict"]),
                              st.lists(st.integers(0, 11), min_size=1, max_size=5), st.integers(0, 50)),
                    max_size=25))
def test_it_answers_as_a_dict_of_cached_blocks(ops: list[tuple[str, list[int], int]]) -> None:
    records, model = CachedRecords(12), {}
    for op, keys, k in ops:
        key = keys[0]
        if op == "set":
            records[key] = model[key] = entry(k)  # a stored id keeps its place, as in a dict
        elif op in ("pop", "pop_hash"):
            if key in model:
                got = records.pop(key) if op == "pop" else records.pop_hash(key)
                assert (got.block_hash if op == "pop" else got) == model.pop(key).block_hash  # type: ignore[union-attr]
            else:
                with pytest.raises(KeyError):
                    records.pop(key) if op == "pop" else records.pop_hash(key)
        elif op == "add":  # all or nothing: every id new and distinct
            new = [entry(k + i) for i in range(len(keys))]
            ok = len(set(keys)) == len(keys) and not set(keys) & set(model)
            assert records.add_new(keys, [(e.block_hash, e.parent_hash, e.salt, e.extra) for e in new],
                                   np.stack([e.token_ids for e in new])) == ok
            if ok:
                model.update(zip(keys, new))
        else:  # an eviction's: the records of held ids, all or none
            held = list(dict.fromkeys(keys))
            if set(held) <= set(model):
                taken = records.pop_records(held)
                blocks = records.blocks(held, taken)  # before anything is stored again
                assert [b.token_ids.tolist() for b in blocks] == [model[i].token_ids.tolist() for i in held]
                assert [r[0] for r in taken] == [model.pop(i).block_hash for i in held]
            else:
                with pytest.raises(KeyError):
                    records.pop_records(held)
        same(records, model)


def test_a_batch_of_more_than_64_is_all_or_nothing_too() -> None:
    records = CachedRecords(200)
    ids = list(range(100))
    fields = [(bytes([i]) * 32, bytes(32), b"", b"") for i in ids]
    tokens = np.arange(100 * BS, dtype=np.uint32).reshape(100, BS)
    assert not records.add_new([*ids[:99], 5], fields, tokens)  # block 5 twice: nothing stored
    assert not records and not records.serial.any()
    records[150] = entry(1)
    assert not records.add_new([*ids[:99], 150], fields, tokens)  # block 150 held
    assert list(records) == [150]
    assert records.add_new(ids, fields, tokens, np.array(ids))
    assert list(records) == [150, *ids] and records[7].token_ids.tolist() == tokens[7].tolist()
    records.check_invariants()


def test_the_token_ids_have_one_width_and_a_read_owns_its_copy() -> None:
    records = CachedRecords(4)
    with pytest.raises(KeyError):
        records[4] = entry(0)
    records[1] = entry(9)
    read = records[1]
    with pytest.raises(ValueError, match="4 token ids, not 8"):
        records[2] = entry(3, width=8)  # nothing changed
    assert list(records) == [1] and records.tokens.shape == (4, BS)
    records[1] = entry(20)  # the row is written again: the earlier read keeps its own
    assert read.token_ids.tolist() == [9, 10, 11, 12] and records[1].token_ids.tolist() == [20, 21, 22, 23]
    assert records.get(3) is None and 3 not in records and "x" not in records and -1 not in records


def test_its_invariant_check_fails_on_a_serial_without_a_record() -> None:
    records = CachedRecords(4)
    records[0] = entry(0)
    records.serial[2] = 5
    with pytest.raises(InvariantViolationError):
        records.check_invariants()
