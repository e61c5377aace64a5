import subprocess
import sys

import pytest
import xxhash

from kv_store.keys import KeyNamespace, NamespaceMismatchError, block_keys, hash_block

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
        KeyNamespace("m", "abc", "fp8_e4m3", 4, tp_size=2, tp_rank=1).root_key(),
    }
    assert len(roots) == 7
    assert NS.root_key("tenant-a") == NS.root_key(b"tenant-a")


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
