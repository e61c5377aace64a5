"""router.routing.key_table and the prefix index built on it, against dicts: the same answers on random
sequences of inserts, evictions, memories and lookups (hypothesis), tables small enough to grow;
and the block hasher's reuse, against hashing from scratch."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_store.events import EventKind, KVEvent, KVEventBatch, KVSnapshot, Tier
from kv_store.keys import block_keys
from router.routing.block_hashing import BlockHasher
from router.routing.key_table import KeyTable
from router.routing.prefix_index import PrefixIndex
from tests.unit.router.routing.dict_prefix_index import DictPrefixIndex

# Small keys collide in their home slots; the large ones test the top of the u64 range.
KEYS = st.one_of(st.integers(0, 40), st.integers(2**64 - 8, 2**64 - 1), st.integers(0, 2**64 - 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "zero", "compact"]), st.lists(KEYS, max_size=40)), max_size=30))
def test_the_table_answers_as_a_dict(steps):
    table = KeyTable(1, capacity=16, keep=lambda t: t.values[:, 0] != 0)
    model: dict[int, int] = {}
    for step, (action, keys) in enumerate(steps):
        array = np.array(keys, dtype=np.uint64)
        if action == "insert":
            slots = table.insert(array)  # before reading ``values``, which inserting may replace
            table.values[slots, 0] = step + 1
            model.update(dict.fromkeys(keys, step + 1))
        elif action == "zero":
            slots = table.find(array)
            table.values[slots[slots >= 0], 0] = 0
            model.update({k: 0 for k in keys if k in model})
        else:
            table.compact()
            model = {k: v for k, v in model.items() if v}
        probe = np.array([*model, *keys, 12345], dtype=np.uint64)
        slots = table.find(probe)
        got = [int(table.values[s, 0]) if s >= 0 else 0 for s in slots]  # a zeroed row may be gone
        assert got == [model.get(int(k), 0) for k in probe]
        assert len(table) <= table.capacity / 2


def test_prompt_sized_batches_probe_past_full_windows():
    """Thousands of keys a call (the vectorized probe rounds, then the slot-by-slot tail), many
    sharing home slots, into a table that grows: every key found where it was put."""
    rng = np.random.default_rng(7)
    table = KeyTable(1, capacity=1024)
    held: dict[int, int] = {}
    for batch in range(4):
        keys = np.concatenate([rng.integers(1, 2**64, 1500, dtype=np.uint64, endpoint=False), np.arange(batch * 300, batch * 300 + 600, dtype=np.uint64)])
        slots = table.insert(keys)
        table.values[slots, 0] = batch + 1
        held.update({int(k): batch + 1 for k in keys})
        probe = np.concatenate([np.array(list(held), dtype=np.uint64), rng.integers(1, 2**64, 500, dtype=np.uint64, endpoint=False)])
        slots = table.find(probe)
        assert [int(table.values[s, 0]) if s >= 0 else 0 for s in slots] == [held.get(int(k), 0) for k in probe]
        assert len(table) == len(held)


WORKERS = ["a", "b", "c", "d"]
FEW_KEYS = st.one_of(st.integers(0, 9), st.integers(2**64 - 2, 2**64 - 1))
"""Few keys, so events, memories and lookups keep meeting on the same ones."""
OPS = st.one_of(
    st.tuples(st.just("event"), st.sampled_from(WORKERS), st.sampled_from(list(EventKind)), st.sampled_from(list(Tier)), st.lists(KEYS, max_size=30)),
    st.tuples(st.just("remember"), st.sampled_from(WORKERS), st.lists(KEYS, max_size=30), st.integers(0, 10)),
    st.tuples(st.just("remember_found"), st.sampled_from(WORKERS), st.lists(KEYS, max_size=30), st.integers(0, 10), st.integers(0, 30), st.lists(KEYS, max_size=5)),
    st.tuples(st.just("forget"), st.integers(0, 10)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS)),
    st.tuples(st.just("snapshot"), st.sampled_from(WORKERS), st.lists(KEYS, max_size=30), st.lists(KEYS, max_size=10)),
    st.tuples(st.just("gap"), st.sampled_from(WORKERS)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, min_size=8, max_size=40), st.lists(FEW_KEYS, max_size=16))
def test_the_index_answers_as_the_dict_index_did(ops, prompt):
    new, old = PrefixIndex(capacity=16), DictPrefixIndex()
    for op in ops:
        for index in (new, old):
            _run(index, op)
        for keys in (prompt, next((part for part in op if isinstance(part, list)), [])):
            assert new.match(keys) == old.match(keys) == new.match(new.lookup(keys))
            assert new.match(keys, ["b", "z", "a"]) == old.match(keys, ["b", "z", "a"])
        assert new.oldest_remembered_s() == old.oldest_remembered_s()
        assert {(w, t): new.num_keys(w, t) for w in WORKERS for t in Tier} == {(w, t): old.num_keys(w, t) for w in WORKERS for t in Tier}


def _run(index, op) -> None:
    if op[0] == "event":
        _, worker, kind, tier, keys = op
        seq = index.seq(worker) + 1 if worker in index.workers else 1
        index.apply(KVEventBatch(worker, seq, (KVEvent(kind, tier, () if kind is EventKind.CLEARED else tuple(keys)),)))
    elif op[0] == "remember":
        index.remember(op[1], op[2], float(op[3]))
    elif op[0] == "remember_found":  # a routing step's one lookup, stale when other keys came in between
        _, worker, keys, until_s, start, others = op
        found = index.lookup(keys) if isinstance(index, PrefixIndex) else None
        index.remember("e", others, float(until_s))
        index.remember(worker, found.suffix(start) if found else keys[start:], float(until_s))
    elif op[0] == "forget":
        index.forget_expired(float(op[1]))
    elif op[0] == "remove":
        index.remove_worker(op[1])
    elif op[0] == "snapshot":
        index.load_snapshot(KVSnapshot(op[1], 7, {Tier.POOL: frozenset(op[2]), Tier.REDIS: frozenset(op[3])}))
    elif op[1] in index.workers:
        index.apply(KVEventBatch(op[1], index.seq(op[1]) + 1, ()))  # an empty batch moves the sequence on


def test_more_workers_than_a_word_holds():
    new, old = PrefixIndex(capacity=16), DictPrefixIndex()
    keys = list(range(1, 101))
    for index in (new, old):
        index.remember("w0", keys[:10], until_s=5.0)
        for i in range(70):  # workers 64..69 take a second word
            index.apply(KVEventBatch(f"w{i}", 1, (KVEvent(EventKind.STORED, Tier.POOL, tuple(keys[: i + 1])), KVEvent(EventKind.STORED, Tier.CPU, tuple(keys[i + 1 : i + 3])))))
        index.remove_worker("w3")
    assert new.match(keys) == old.match(keys)
    assert new.match(keys)["w69"].pool == 70
    for index in (new, old):
        index.forget_expired(5.0)
    assert new.match(keys) == old.match(keys)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 200), st.lists(st.integers(0, 50), max_size=120), st.integers(1, 2)), min_size=1, max_size=12))
def test_the_block_hasher_gives_the_workers_keys_whatever_it_reuses(steps):
    """Prompts that branch off earlier ones at any token, two roots, generations that turn over."""
    hasher = BlockHasher(4, max_blocks=64, reuse=True)
    prompts: list[list[int]] = []
    for parent, cut, tail, root in steps:
        base = prompts[parent % len(prompts)][:cut] if prompts else []
        prompt = base + tail
        prompts.append(prompt)
        assert hasher.keys(prompt, root).tolist() == block_keys(prompt, 4, root)
