import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_store import keys as keys_module
from kv_store.keys import KeyNamespace, NamespaceMismatchError, block_keys, hash_block
from tests.native import built_or_skip

NS = KeyNamespace(model_name="m", weights_fingerprint="abc", kv_dtype="fp8_e4m3", block_size=4)


def test_chain_matches_the_spec_byte_encoding():
    root = NS.root_key()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    k0 = xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens[:4]))
    k1 = xxhash.xxh3_64_intdigest(k0.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens[4:8]))
    assert block_keys(tokens, 4, root) == [k0, k1]


def test_partial_block_gets_no_key_and_chain_extends_without_rehash():
    root = NS.root_key()
    full = block_keys(list(range(12)), 4, root)
    assert len(full) == 3
    assert block_keys(list(range(11)), 4, root) == full[:2]
    assert block_keys(list(range(12)), 4, full[1], start_block=2) == full[2:]


def test_keys_depend_on_whole_prefix():
    root = NS.root_key()
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, root)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, root)
    assert a[1] != b[1]


def test_namespace_fields_and_tenant_salt_change_the_root():
    roots = {
        NS.root_key(),
        NS.root_key("tenant-a"),
        NS.root_key("tenant-b"),
        KeyNamespace("m", "abd", "fp8_e4m3", 4).root_key(),
        KeyNamespace("m", "abc", "bf16", 4).root_key(),
        KeyNamespace("m", "abc", "fp8_e4m3", 8).root_key(),
        KeyNamespace("m", "abc", "fp8_e4m3", 4, key_spec_version=1).root_key(),
    }
    assert len(roots) == 7
    assert NS.root_key("tenant-a") == NS.root_key(b"tenant-a")


def test_the_root_is_the_spec_encoding_of_the_namespace_without_the_shard():
    canonical = b"splitserve-kv\x00" + b"\x1f".join([b"m", b"abc", b"fp8_e4m3", b"4", b"2"])
    assert keys_module.KEY_SPEC_VERSION == 2
    assert NS.root_key() == xxhash.xxh3_64_intdigest(canonical + b"\x00salt\x00")
    assert NS.root_key("t") == xxhash.xxh3_64_intdigest(canonical + b"\x00salt\x00t")


def test_the_tp_shard_changes_neither_the_root_nor_the_fingerprint():
    shard = KeyNamespace("m", "abc", "fp8_e4m3", 4, tp_size=4, tp_rank=3)
    assert (shard.root_key(), shard.root_key("t"), shard.fingerprint) == (NS.root_key(), NS.root_key("t"), NS.fingerprint)
    assert block_keys(list(range(8)), 4, shard.root_key()) == block_keys(list(range(8)), 4, NS.root_key())
    assert set(shard.differences(NS)) == {"tp_size", "tp_rank"}  # still named: the hand-off maps shards
    other_dtype = KeyNamespace("m", "abc", "bf16", 4, tp_size=4, tp_rank=3)
    assert other_dtype.root_key() != NS.root_key() and other_dtype.fingerprint != NS.fingerprint


def test_keys_are_stable_across_processes_and_hash_seeds():
    code = (
        "from kv_store.keys import KeyNamespace, block_keys;"
        "ns = KeyNamespace('m', 'abc', 'fp8_e4m3', 4);"
        "print(block_keys(list(range(8)), 4, ns.root_key('t')))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
        for seed in ("1", "2")
    }
    assert outs == {str(block_keys(list(range(8)), 4, NS.root_key("t"))) + "\n"}


def test_key_module_does_not_import_torch():
    code = "import sys, kv_store.keys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_mismatch_names_every_differing_field():
    other = KeyNamespace(model_name="m", weights_fingerprint="abc", kv_dtype="bf16", block_size=16)
    with pytest.raises(NamespaceMismatchError) as e:
        NS.require_same(other, "router", "worker")
    assert set(e.value.differing) == {"kv_dtype", "block_size"}
    assert "kv_dtype: router='fp8_e4m3' vs worker='bf16'" in str(e.value)
    NS.require_same(KeyNamespace("m", "abc", "fp8_e4m3", 4))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"kv_dtype": "int4"}, "kv_dtype"), ({"block_size": 0}, "block_size"), ({"tp_rank": 2, "tp_size": 2}, "tp_rank"), ({"model_name": ""}, "model_name")],
)
def test_bad_namespace_names_the_field(kwargs, field):
    base = dict(model_name="m", weights_fingerprint="abc", kv_dtype="fp32", block_size=4)
    with pytest.raises(ValueError, match=f"^{field}"):
        KeyNamespace(**{**base, **kwargs})


def test_token_ids_must_be_u32():
    with pytest.raises(ValueError, match="token_ids: -1"):
        hash_block(0, [1, -1])


@pytest.fixture(scope="module")
def native_chain():
    """The C extension kv_store._chain (where it is not built the Python loop gives the same keys)."""
    return built_or_skip(keys_module._chain, "kv_store._chain", "gcc and /usr/include/xxhash.h (libxxhash-dev, `make system-deps`)",
                         "keys come from the Python loop")


def test_the_native_chain_is_built_where_required(native_chain):
    assert keys_module.NATIVE_CHAIN


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.integers(1, 40),
    root=st.integers(0, 2**64 - 1),
)
def test_the_native_chain_gives_the_python_loops_keys(native_chain, tokens, block_size, root):
    """Whole blocks, partial tails (block_keys drops them) and empty prompts, any u32 id and root."""
    num_full = len(tokens) // block_size * block_size
    packed = np.asarray(tokens[:num_full], dtype="<u4")
    expected = keys_module.python_packed_block_keys(packed, block_size, root)
    assert np.frombuffer(native_chain.chain_keys(packed, block_size, root), dtype=np.uint64).tolist() == expected
    assert keys_module.packed_block_key_array(packed.tobytes(), block_size, root).tolist() == expected
    assert block_keys(tokens, block_size, root) == expected


def test_without_the_extension_the_python_loop_gives_the_same_keys(monkeypatch):
    root, tokens = NS.root_key(), np.arange(1000, 1064, dtype="<u4")
    native = keys_module.packed_block_key_array(tokens, 4, root)
    monkeypatch.setattr(keys_module, "_chain", None)
    fallback = keys_module.packed_block_key_array(tokens, 4, root)
    assert fallback.dtype == np.uint64 and fallback.tolist() == native.tolist() == block_keys(tokens.tolist(), 4, root)


@pytest.mark.parametrize("native", [True, False])
def test_bad_chain_arguments_are_named_the_same_on_both_paths(request, monkeypatch, native):
    if native:
        request.getfixturevalue("native_chain")
    else:
        monkeypatch.setattr(keys_module, "_chain", None)
    tokens = np.arange(8, dtype="<u4")
    with pytest.raises(ValueError, match="block_size: must be >= 1, got 0"):
        keys_module.packed_block_key_array(tokens, 0, 1)
    with pytest.raises(ValueError, match="parent_key: -1 is not a u64 key"):
        keys_module.packed_block_key_array(tokens, 4, -1)
    with pytest.raises(ValueError, match="parent_key: 18446744073709551616"):
        keys_module.packed_block_key_array(tokens, 4, 2**64)
    with pytest.raises(ValueError):
        keys_module.packed_block_key_array(tokens[:7], 4, 1)  # 28 bytes: not whole 4-token blocks


def test_the_native_chain_names_a_partial_block(native_chain):
    with pytest.raises(ValueError, match="data: 28 bytes is not a whole number of 4-token blocks"):
        native_chain.chain_keys(np.arange(7, dtype="<u4"), 4, 1)
