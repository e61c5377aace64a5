"""Hand-off messages: validation, compatibility errors that name every field, pickling, light imports."""

import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_transfer.errors import HandOffError, KVTransferError
from kv_transfer.protocol import (
    PROTOCOL_VERSION,
    KVEndpoint,
    TransferRequest,
    TransferResult,
    TransferStatus,
    check_compatible,
    parse_notif,
    request_id_of,
)
from kv_transfer.registry import transport_class

NAMESPACE = KeyNamespace(model_name="smollm2-135m", weights_fingerprint="abc123", kv_dtype="fp8_e4m3", block_size=16)


def _endpoint(name="decode-0", heads=(0, 2), tp=(1, 0), **changes) -> KVEndpoint:
    namespace = replace(NAMESPACE, tp_size=tp[0], tp_rank=tp[1], **changes.pop("namespace", {}))
    layout = KVBlockLayout(
        num_layers=changes.pop("num_layers", 30),
        num_kv_heads=heads[1] - heads[0],
        head_dim=changes.pop("head_dim", 64),
        block_size=namespace.block_size,
        kv_dtype=namespace.kv_dtype,
    )
    return KVEndpoint(name, b"metadata", namespace, layout, num_blocks=64, head_start=heads[0], head_end=heads[1], **changes)


def test_a_tensor_parallel_rank_may_fill_a_whole_decode_worker():
    decode = _endpoint()
    prefill_rank_1 = _endpoint("prefill-0-rank-1", heads=(1, 2), tp=(2, 1))
    check_compatible(decode, prefill_rank_1)
    check_compatible(prefill_rank_1, decode)


def test_every_differing_field_is_named():
    decode = _endpoint()
    other = _endpoint(
        "prefill-9",
        num_layers=24,
        namespace=dict(weights_fingerprint="fff", kv_dtype="bf16", block_size=32),
        protocol_version=PROTOCOL_VERSION + 1,
    )
    with pytest.raises(HandOffError) as caught:
        check_compatible(decode, other)
    assert caught.value.differing == {
        "protocol_version": (PROTOCOL_VERSION, PROTOCOL_VERSION + 1),
        "weights_fingerprint": ("abc123", "fff"),
        "kv_dtype": ("fp8_e4m3", "bf16"),
        "block_size": (16, 32),
        "num_layers": (30, 24),
    }
    message = str(caught.value)
    assert "'decode-0' and 'prefill-9'" in message
    assert "weights_fingerprint: local='abc123' vs remote='fff'" in message
    assert "block_size: local=16 vs remote=32" in message


def test_ranks_with_different_heads_are_compatible_and_the_plan_places_heads():
    check_compatible(_endpoint(heads=(0, 2), tp=(3, 0)), _endpoint("p", heads=(1, 3), tp=(3, 1)))  # heads are the plan's business


def test_writer_notifications_name_the_rank_and_the_number_of_writers():
    request = TransferRequest(request_id="req-1", decode=_endpoint(), block_ids=(3,), num_prompt_tokens=5)
    notif = request.writer_notif(2, 3)
    assert parse_notif(notif) == (request.notif, 2, 3)
    assert parse_notif(request.writer_notif(1, 1)) == (request.notif, 1, 1)  # the only writer into a rank may be prefill rank 1
    assert request_id_of(notif) == "req-1"
    for bad in (request.notif + b"|3/0", request.notif + b"|x/2", b"other|0/1"):
        with pytest.raises(KVTransferError, match="not a splitserve KV hand-off notification"):
            parse_notif(bad)


def test_decode_ranks_start_with_the_decode_endpoint():
    rank0, rank1 = _endpoint("d-0", heads=(0, 1), tp=(2, 0)), _endpoint("d-1", heads=(1, 2), tp=(2, 1))
    request = TransferRequest(request_id="r", decode=rank0, block_ids=(1,), num_prompt_tokens=3, decode_ranks=(rank0, rank1))
    assert request.decode_endpoints == (rank0, rank1)
    with pytest.raises(ValueError, match="decode_ranks: must start with the decode endpoint"):
        replace(request, decode_ranks=(rank1, rank0))


def test_endpoint_validation():
    with pytest.raises(ValueError, match="not the layout's 2 heads"):
        replace(_endpoint(), head_end=3)
    with pytest.raises(ValueError, match="kv_dtype: namespace says 'bf16', layout 'fp8_e4m3'"):
        replace(_endpoint(), namespace=replace(NAMESPACE, kv_dtype="bf16"))
    with pytest.raises(ValueError, match="transport_metadata: must be bytes"):
        replace(_endpoint(), transport_metadata="not bytes")


def test_request_maps_blocks_to_the_prompt_tail():
    request = TransferRequest("req-1", _endpoint(), block_ids=[7, 3, 9], num_prompt_tokens=70, first_block_index=2)
    assert request.block_ids == (7, 3, 9)
    assert request.num_prompt_blocks == 5  # 4 full blocks of 16 and one of 6 tokens
    assert request.prompt_block_indices == range(2, 5)
    assert request.decode_endpoints[0].heads == range(0, 2)
    assert request_id_of(request.notif) == "req-1"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(block_ids=[7, 3]), r"block_ids: 2 given, prompt blocks \[2, 5\) need 3"),
        (dict(block_ids=[7, 3, 64]), r"block_ids: \[64\] outside the decode pool's blocks \[0, 64\)"),
        (dict(block_ids=[7, 3, 7]), "block_ids: a block appears twice"),
        (dict(first_block_index=6, block_ids=[]), "first_block_index: 6 outside the prompt's 5 blocks"),
        (dict(timeout_s=0), "timeout_s: must be > 0"),
        (dict(request_id=""), "request_id: must not be empty"),
    ],
)
def test_bad_requests_are_refused(changes, message):
    fields = dict(request_id="req-1", decode=_endpoint(), block_ids=[7, 3, 9], num_prompt_tokens=70, first_block_index=2)
    with pytest.raises(ValueError, match=message):
        TransferRequest(**{**fields, **changes})


def test_a_fully_cached_prompt_needs_no_blocks():
    request = TransferRequest("req-2", _endpoint(), block_ids=[], num_prompt_tokens=32, first_block_index=2)
    assert request.prompt_block_indices == range(2, 2)


def test_foreign_notifications_are_not_taken_for_ours():
    with pytest.raises(KVTransferError, match="not a splitserve KV hand-off notification"):
        request_id_of(b"some-other-tag/req-1")


def test_result_status_and_error_agree():
    assert TransferResult("r", "done", block_ids=[1, 2], first_token_id=5).status is TransferStatus.DONE
    assert not TransferResult("r", TransferStatus.TIMED_OUT, error="write not done within 2.0 s").ok
    with pytest.raises(ValueError, match="error: must be empty exactly when status is done"):
        TransferResult("r", TransferStatus.FAILED)
    with pytest.raises(ValueError, match="error: must be empty exactly when status is done"):
        TransferResult("r", TransferStatus.DONE, error="oops")


def test_messages_and_errors_survive_pickling():
    request = TransferRequest("req-1", _endpoint(), block_ids=[7, 3, 9], num_prompt_tokens=70, first_block_index=2)
    result = TransferResult("req-1", TransferStatus.DONE, block_ids=[7, 3, 9], first_token_id=11, num_bytes=555)
    assert pickle.loads(pickle.dumps(request)) == request
    assert pickle.loads(pickle.dumps(result)) == result
    error = HandOffError("differs", {"kv_dtype": ("fp8_e4m3", "bf16")})
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is HandOffError and str(copy) == "differs" and copy.differing == error.differing


def test_protocol_needs_no_torch_and_the_package_no_nixl():
    code = (
        "import sys, kv_transfer.protocol; assert 'torch' not in sys.modules, 'torch'; "
        "import kv_transfer.codec, kv_transfer.nixl_transport, kv_transfer.registry; "
        "assert not any(m.split('.')[0].startswith('nixl') for m in sys.modules), 'nixl'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_transports_are_found_by_name():
    assert transport_class("nixl").__name__ == "NixlTransport"
    with pytest.raises(ValueError, match=r"transport: 'tcp' is not one of \['nixl'\]"):
        transport_class("tcp")


def test_open_endpoint_registers_the_pool_under_a_fresh_agent_name_per_call():
    """Every worker rank opens its endpoint through open_endpoint: the endpoint describes the pool
    and heads given, a TP rank advertises its rank, and a replica id that comes back never reuses
    an agent name (a peer caching the old pool address must not write into the new pool)."""
    import torch

    from kv_transfer.registry import open_endpoint

    layout = _endpoint(heads=(2, 4)).layout

    class Pool:
        buffer = torch.zeros(4, layout.block_bytes, dtype=torch.uint8)
        num_blocks = 4

    Pool.layout = layout
    tp_namespace = replace(NAMESPACE, tp_size=2)
    first, endpoint = open_endpoint("nixl", "decode-0", Pool, range(2, 4), tp_namespace, rank=1)
    _, again = open_endpoint("nixl", "decode-0", Pool, range(2, 4), NAMESPACE)
    assert endpoint.agent_name.startswith("decode-0-rank1-") and again.agent_name.startswith("decode-0-")
    assert endpoint.agent_name != again.agent_name and "rank" not in again.agent_name
    assert (endpoint.head_start, endpoint.head_end, endpoint.num_blocks, endpoint.layout) == (2, 4, 4, layout)
    assert endpoint.namespace.tp_rank == 1 and again.namespace == NAMESPACE
    assert endpoint.transport_metadata == first.metadata()
