"""The prefill-to-decode KV hand-off as plain frozen dataclasses: what crosses Ray between workers.

::

    decode worker                                       prefill worker
    allocate blocks for the uncached prompt blocks
    TransferRequest(decode endpoints, block_ids) ---->  check_compatible(own endpoint, each decode rank's)
                                                        compute; each rank WRITEs the heads it ships
    each rank: a notification from every writer  <----  (writer_notif(rank, n): n writers into that rank)
    add the sequence to the running batch        <----  TransferResult(status, first token, rank writes)

Between tensor-parallel replicas each decode rank receives its KV heads from the prefill ranks
that hold them, and each head from exactly one of them (kv_transfer/handoff.py plans who
writes what); a decode rank knows it has everything when it has a notification from each of
the ``n`` writers its notifications name.

No torch here: the router and the controller handle endpoints too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_transfer.errors import HandOffError, KVTransferError

PROTOCOL_VERSION = 4
"""Bumped whenever a message below or the meaning of a notification changes."""

_NOTIF_PREFIX = b"splitserve-kv/1/"

_SHARD_FIELDS = ("tp_size", "tp_rank")
"""Namespace fields that legitimately differ between a prefill rank and a decode worker."""


@dataclass(frozen=True)
class KVEndpoint:
    """What a worker advertises so that peers can write KV blocks into its pool."""

    agent_name: str
    """Transport agent name, unique in the cluster."""
    transport_metadata: bytes
    """What a peer's transport needs to reach this pool: NixlTransport.metadata(). Workers
    publish it once, through the controller; the copy inside a TransferRequest is left empty."""
    namespace: KeyNamespace
    """Key namespace of the blocks in the pool; fixes model, weights, KV dtype and block size."""
    layout: KVBlockLayout
    """Byte layout of one block of the pool."""
    num_blocks: int
    """Blocks in the pool."""
    head_start: int
    """First KV head of the model that the pool's blocks hold."""
    head_end: int
    """One past the last KV head that the pool's blocks hold."""
    protocol_version: int = PROTOCOL_VERSION
    """Hand-off protocol spoken by the worker."""
    layer_start: int = 0
    """First layer of the model whose KV the pool's blocks hold (a pipeline stage's)."""
    layer_end: int = 0
    """One past the last such layer; 0: the layout's layers from ``layer_start``."""
    num_model_layers: int = 0
    """Layers of the model; 0: ``layer_end`` (the pool holds the last layers)."""

    def __post_init__(self) -> None:
        if self.layer_end == 0:
            object.__setattr__(self, "layer_end", self.layer_start + self.layout.num_layers)
        if self.num_model_layers == 0:
            object.__setattr__(self, "num_model_layers", self.layer_end)
        if self.layer_end - self.layer_start != self.layout.num_layers or not 0 <= self.layer_start < self.layer_end <= self.num_model_layers:
            raise ValueError(
                f"layer_start, layer_end: [{self.layer_start}, {self.layer_end}) is not the layout's {self.layout.num_layers} layers "
                f"of a model of {self.num_model_layers}"
            )
        if not self.agent_name:
            raise ValueError("agent_name: must not be empty")
        if not isinstance(self.transport_metadata, bytes):
            raise ValueError(f"transport_metadata: must be bytes, got {type(self.transport_metadata).__name__}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")
        if not 0 <= self.head_start < self.head_end:
            raise ValueError(f"head_start, head_end: [{self.head_start}, {self.head_end}) is not a range of heads")
        if self.head_end - self.head_start != self.layout.num_kv_heads:
            raise ValueError(
                f"head_start, head_end: [{self.head_start}, {self.head_end}) is not the layout's "
                f"{self.layout.num_kv_heads} heads"
            )
        for name in ("kv_dtype", "block_size"):
            if getattr(self.namespace, name) != getattr(self.layout, name):
                raise ValueError(
                    f"{name}: namespace says {getattr(self.namespace, name)!r}, layout {getattr(self.layout, name)!r}"
                )

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_end)

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def shard(self) -> tuple[range | None, range]:
        """``(layers, heads)`` for the hand-off plan (``kv_transfer.handoff.plan_writes``); layers
        None when the pool holds every layer of the model."""
        whole = self.layer_start == 0 and self.layer_end == self.num_model_layers
        return (None if whole else self.layers), self.heads


def check_compatible(local: KVEndpoint, remote: KVEndpoint) -> None:
    """Raise HandOffError naming every field that keeps ``local`` and ``remote`` from exchanging blocks.

    They must agree on the protocol version, the namespace (model, weights, KV dtype, block size;
    not the TP shard fields), the model's layers and the head width of a block. Which heads and
    layers go where is the hand-off plan's business (kv_transfer/handoff.py), not a pairwise check.
    """
    differing: dict[str, tuple[object, object]] = {}
    if local.protocol_version != remote.protocol_version:
        differing["protocol_version"] = (local.protocol_version, remote.protocol_version)
    for name, pair in local.namespace.differences(remote.namespace).items():
        if name not in _SHARD_FIELDS:
            differing[name] = pair
    if local.num_model_layers != remote.num_model_layers:
        differing["num_layers"] = (local.num_model_layers, remote.num_model_layers)
    if local.layout.head_dim != remote.layout.head_dim:
        differing["head_dim"] = (local.layout.head_dim, remote.layout.head_dim)
    if differing:
        parts = ", ".join(f"{name}: local={a!r} vs remote={b!r}" for name, (a, b) in differing.items())
        raise HandOffError(
            f"KV hand-off between {local.agent_name!r} and {remote.agent_name!r} is impossible ({parts})", differing
        )


@dataclass(frozen=True)
class TransferRequest:
    """A decode worker's ask to a prefill worker: fill these blocks of my pool with the prompt's KV.

    The prompt's blocks before ``first_block_index`` are already in the decode worker's pool (its
    own prefix-cache hit); ``block_ids[i]`` receives prompt block ``first_block_index + i``, up to
    and including the last, partial one. The heads to fill are the decode endpoint's. The prompt's
    tokens travel in the prefill call itself, not here.
    """

    request_id: str
    """The hand-off's id: unique among the hand-offs in flight (a request re-submitted gets a new one)."""
    decode: KVEndpoint
    """The decode worker's endpoint (its leader rank's), for the compatibility check; its transport
    metadata reached the prefill worker before, through the controller (``add_kv_peers``), and is
    not repeated here."""
    block_ids: tuple[int, ...]
    """Decode pool block ids to fill, in prompt order."""
    num_prompt_tokens: int
    """Tokens in the whole prompt."""
    first_block_index: int = 0
    """Index of the prompt block that block_ids[0] receives."""
    timeout_s: float = 30.0
    """Time allowed, from the prefill worker's receipt of the request, until the write completes."""
    protocol_version: int = PROTOCOL_VERSION
    """Hand-off protocol spoken by the decode worker."""
    decode_ranks: tuple[KVEndpoint, ...] = ()
    """Every rank's endpoint of a tensor-parallel decode replica, rank 0 (``decode``) first; empty
    for a replica of one rank. Every rank's pool has the same blocks: ``block_ids`` name them in each."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "decode_ranks", tuple(self.decode_ranks))
        if self.decode_ranks and self.decode_ranks[0].agent_name != self.decode.agent_name:
            raise ValueError("decode_ranks: must start with the decode endpoint (rank 0)")
        if not self.request_id:
            raise ValueError("request_id: must not be empty")
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens: must be >= 1, got {self.num_prompt_tokens}")
        if not 0 <= self.first_block_index <= self.num_prompt_blocks:
            raise ValueError(
                f"first_block_index: {self.first_block_index} outside the prompt's {self.num_prompt_blocks} blocks"
            )
        expected = self.num_prompt_blocks - self.first_block_index
        if len(self.block_ids) != expected:
            raise ValueError(
                f"block_ids: {len(self.block_ids)} given, prompt blocks [{self.first_block_index}, "
                f"{self.num_prompt_blocks}) need {expected}"
            )
        bad = [b for b in self.block_ids if not 0 <= b < self.decode.num_blocks]
        if bad:
            raise ValueError(f"block_ids: {bad} outside the decode pool's blocks [0, {self.decode.num_blocks})")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(f"block_ids: a block appears twice in {list(self.block_ids)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    @property
    def num_prompt_blocks(self) -> int:
        """Blocks the whole prompt occupies, the last one possibly partial."""
        return -(-self.num_prompt_tokens // self.decode.layout.block_size)

    @property
    def prompt_block_indices(self) -> range:
        """Prompt block indices that ``block_ids`` receive, in the same order."""
        return range(self.first_block_index, self.num_prompt_blocks)

    @property
    def decode_endpoints(self) -> tuple[KVEndpoint, ...]:
        """The decode replica's rank endpoints, rank 0 first."""
        return self.decode_ranks or (self.decode,)

    @property
    def notif(self) -> bytes:
        """The hand-off's notification; each writer sends it with its rank appended (``writer_notif``)."""
        return _NOTIF_PREFIX + self.request_id.encode()

    def writer_notif(self, writer_rank: int, num_writers: int) -> bytes:
        """What prefill rank ``writer_rank``'s write carries into a decode rank that ``num_writers`` ranks write."""
        return self.notif + f"{_WRITER_SEP}{writer_rank}/{num_writers}".encode()


_WRITER_SEP = "|"


def parse_notif(notif: bytes) -> tuple[bytes, int, int]:
    """``(hand-off notification, writer rank, number of writers)`` of a writer's notification;
    KVTransferError if it is not one."""
    base, sep, writer = notif.rpartition(_WRITER_SEP.encode())
    try:
        rank, num_writers = (int(x) for x in writer.split(b"/"))
    except ValueError:
        rank, num_writers = -1, 0
    if not sep or not base.startswith(_NOTIF_PREFIX) or len(base) == len(_NOTIF_PREFIX) or rank < 0 or num_writers < 1:
        raise KVTransferError(f"notification {notif[:64]!r} is not a splitserve KV hand-off notification")
    return base, rank, num_writers


def request_id_of(notif: bytes) -> str:
    """The request id a notification (TransferRequest.notif or a writer's) belongs to; KVTransferError if it is not one."""
    if _WRITER_SEP.encode() in notif:
        notif = parse_notif(notif)[0]
    if not notif.startswith(_NOTIF_PREFIX) or len(notif) == len(_NOTIF_PREFIX):
        raise KVTransferError(f"notification {notif[:64]!r} is not a splitserve KV hand-off notification")
    return notif[len(_NOTIF_PREFIX) :].decode()


class TransferState(str, Enum):
    """State of a posted write, as NIXL names it (what a transport's handle polls to)."""

    DONE = "DONE"
    PROC = "PROC"


class TransferStatus(str, Enum):
    """How a hand-off ended."""

    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class RankWrite:
    """One prefill rank's WRITE into one decode rank's pool during a hand-off."""

    prefill_rank: int
    decode_rank: int
    head_start: int
    """First model KV head written."""
    head_end: int
    num_blocks: int
    num_bytes: int


@dataclass(frozen=True)
class TransferResult:
    """A prefill worker's answer to a TransferRequest."""

    request_id: str
    """The request's id."""
    status: TransferStatus
    """DONE when every requested block was written; otherwise the decode worker applies its failure policy."""
    block_ids: tuple[int, ...] = ()
    """Decode block ids whose bytes are now valid (all of the request's when DONE)."""
    first_token_id: int | None = None
    """Token sampled after the prompt's last position; None when the prefill did not get that far."""
    first_token_logprob: float | None = None
    """The first token's log-probability where the request asks for them (``params.logprobs``), else None."""
    first_token_top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most likely tokens there as (token id, log-probability), most likely first (``params.logprobs`` of them)."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefill worker found cached instead of computing."""
    num_bytes: int = 0
    """Bytes written into the decode pool."""
    transfer_s: float = 0.0
    """Seconds from posting the write to its completion."""
    error: str = ""
    """Why the hand-off did not complete; empty when DONE."""
    rank_writes: tuple[RankWrite, ...] = ()
    """Which prefill rank wrote which KV heads into which decode rank, and how much."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TransferStatus(self.status))
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        if (self.status is TransferStatus.DONE) == bool(self.error):
            raise ValueError(f"error: must be empty exactly when status is done, got {self.status.value} / {self.error!r}")

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE

