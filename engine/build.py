"""An engine's parts: its rank's slice of the model and of the KV pool, and its speculator.

The leader (``LLMEngine``) and every follower rank (``engine.parallel.follower``) build their
shard the same way, so one block id names the same tokens on every rank.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.bundled import resolve_model, source_gguf
from engine.config import EngineConfig
from engine.kv_cache import PagedKVCache
from engine.loader.gguf_native import read_native_tensors
from engine.loader.weights import load_weights, weights_fingerprint
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.parallel.group import TPGroup
from engine.parallel.pipeline import PipelineGroup, Stage, stage_layers
from engine.parallel.tier_mirror import FollowerMirror
from engine.quant.apply import apply_weights, check_weights_dtype, load_native, set_act_planes
from engine.spec.draft import DraftModelProposer
from engine.spec.policy import SpecPolicy
from engine.spec.speculator import NgramProposer, Speculator
from kv_store.block_pool import BlockPool
from kv_store.cpu_tier import CPUTier
from kv_store.data_parallel import DataParallelKVStore, EventUnion
from kv_store.events import KVEventLog
from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.tiered import RedisKeys, TieredKVStore

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """Longest prompt plus output the engine serves: the configured length, capped by the model's context and sliding window."""
    limits = [config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings]
    return min(limits + ([mc.sliding_window] if mc.sliding_window else []))


def key_namespace(config: EngineConfig, model_name: str, checkpoint_dir: Path, tp_size: int) -> KeyNamespace:
    """The namespace a replica's blocks are keyed (and its Redis values checked) in; every rank
    makes the same one."""
    return KeyNamespace(
        model_name=model_name,
        weights_fingerprint=weights_fingerprint(checkpoint_dir, precision=f"dtype={config.dtype} weights={config.weights}"),
        kv_dtype=config.kv_dtype,
        block_size=config.block_size,
        tp_size=tp_size,
    )


def build_kv_store(
    config: EngineConfig,
    pools: list[BlockPool],
    kv_cache: PagedKVCache,
    kv_heads: range,
    num_model_kv_heads: int,
    namespace: KeyNamespace,
    events: KVEventLog,
    tp: TPGroup,
    ep: TPGroup,
) -> TieredKVStore | DataParallelKVStore:
    """The leader's KV tiers: the CPU tier and Redis (its heads' values, ``kv_heads`` of the
    model's ``num_model_kv_heads``) as configured, under ``pools`` (one per data-parallel rank).

    A tensor-parallel replica with tiers has every other rank move its own slice of each block
    (engine/parallel/tier_mirror.py); an expert-parallel one keeps a store per rank, each rank
    moving its own blocks (kv_store/data_parallel.py)."""
    layout = kv_cache.layout
    redis = None
    if config.redis_url is not None:
        redis_config = RedisTierConfig(config.redis_url, config.redis_ttl_s, tls_ca_file=config.redis_tls_ca_file)
        redis = RedisTier(redis_config, namespace, layout, head_start=kv_heads.start, num_model_kv_heads=num_model_kv_heads)
    tiered = config.cpu_kv_cache_bytes > 0 or redis is not None

    def cpu_tier(bytes_elsewhere: bool = False) -> CPUTier | None:
        if not config.cpu_kv_cache_bytes:
            return None  # pinned for a GPU pool: its blocks move on a side stream (kv_store/block_copier.py)
        return CPUTier(config.cpu_kv_cache_bytes, layout.block_bytes, pin_memory=kv_cache.buffer.is_cuda and not bytes_elsewhere, bytes_elsewhere=bytes_elsewhere)

    if ep.size == 1:
        mirror = FollowerMirror(tp) if tp.size > 1 and tiered else None
        return TieredKVStore(pools[0], kv_cache.buffer, events, cpu_tier(), redis, mirror=mirror)
    union, redis_keys = EventUnion(events, ep.size), RedisKeys(events)
    stores = [TieredKVStore(pools[0], kv_cache.buffer, union.rank(0), cpu_tier(), redis, redis_keys=redis_keys)]
    elsewhere = torch.empty(tuple(kv_cache.buffer.shape), dtype=torch.uint8, device="meta")  # rank r's pool: its bytes are on rank r
    for rank in range(1, ep.size):
        mirror = FollowerMirror(ep, rank) if tiered else None
        stores.append(TieredKVStore(pools[rank], elsewhere, union.rank(rank), cpu_tier(bytes_elsewhere=True), redis, mirror=mirror, redis_keys=redis_keys))
    return DataParallelKVStore(stores, events, redis_keys, redis)


def split_group(config: EngineConfig, group: TPGroup | PipelineGroup) -> tuple[TPGroup, TPGroup]:
    """``(tp, ep)``: the group is the tensor-parallel one or the expert-parallel one (never both);
    a pipelined replica's tensor-parallel group is its stage's."""
    single = TPGroup.single()
    if isinstance(group, PipelineGroup):
        return group.tp, single
    return (group, single) if config.tp_size > 1 else (single, group) if config.ep_size > 1 else (single, single)


def build_shard(
    config: EngineConfig, mc: ModelConfig, checkpoint_dir: Path, max_model_len: int, tp: TPGroup, ep: TPGroup | None = None, stage: Stage | None = None
) -> tuple[DecoderModel, PagedKVCache]:
    """This rank's slice of the model, loaded, and its slice of the paged KV pool.

    Every rank sizes its pool alike. Tensor-parallel ranks hold their KV heads of the same
    blocks (one block id names the same tokens on every rank); expert-parallel ranks hold every
    head for requests of their own; a pipeline ``stage`` holds its layers' weights and K/V only,
    as many blocks as the largest stage's layers fit. Each rank computes on its group's device
    (``shard_device``).
    """
    check_weights_dtype(config.weights, config.dtype)
    if config.device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device: {config.device!r}, but torch {torch.__version__} sees no CUDA GPU on this machine")
    device = shard_device(config, tp, ep)
    if device != "cpu":
        check_cuda_device(device, torch.cuda.device_count())
    model = DecoderModel.empty(mc, max_model_len, TORCH_DTYPES[config.dtype], tp, ep, stage)
    gguf_path = source_gguf(checkpoint_dir) if config.weights == "native" else None
    if gguf_path is not None:
        native = read_native_tensors(gguf_path, mc)
        load_native(model, checkpoint_dir, {name: tensor for name, tensor in native.items() if model.holds_tensor(name)})
    else:
        load_weights(model, checkpoint_dir)
        apply_weights(model, config.weights)
    set_act_planes(model, config.act_planes)
    if device == "cpu":
        model.bind_fused_layers()
    else:
        model.to(device)
    layout = KVBlockLayout(len(model.stage.layers), model.num_kv_heads, mc.head_dim, config.block_size, config.kv_dtype)
    largest = max(len(layers) for layers in stage_layers(mc, config.pp_size)) if config.pp_size > 1 else mc.num_layers
    sizing = KVBlockLayout(largest, model.num_kv_heads, mc.head_dim, config.block_size, config.kv_dtype)  # every stage: the same block ids
    num_blocks = config.num_kv_blocks or config.kv_cache_bytes // sizing.block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_bytes: {config.kv_cache_bytes} holds no block of {sizing.block_bytes} bytes")
    if device != "cpu":
        check_pool_fits(device, num_blocks, layout.block_bytes, *torch.cuda.mem_get_info(device))
    return model, PagedKVCache(layout, num_blocks, TORCH_DTYPES[config.dtype], device)


def check_cuda_device(device: str, num_gpus: int) -> None:
    """Refuse ``cuda:N`` where this process sees fewer than N + 1 GPUs."""
    index = int(device.partition(":")[2] or 0)
    if index >= num_gpus:
        raise ValueError(f"device: {device!r} was asked for, but this process sees {num_gpus} CUDA GPU{'s' if num_gpus != 1 else ''} (cuda:0 .. cuda:{num_gpus - 1})")


def check_pool_fits(device: str, num_blocks: int, block_bytes: int, free_bytes: int, total_bytes: int) -> None:
    """Refuse a KV pool larger than the device memory left after the weights."""
    pool_bytes = num_blocks * block_bytes
    if pool_bytes > free_bytes:
        raise ValueError(
            f"kv_cache_bytes: a KV pool of {num_blocks} blocks ({pool_bytes / 2**30:.2f} GiB) was asked for on {device}, which has "
            f"{free_bytes / 2**30:.2f} GiB free of {total_bytes / 2**30:.2f} GiB after the weights; lower kv_cache_bytes or num_kv_blocks"
        )


def shard_device(config: EngineConfig, tp: TPGroup, ep: TPGroup | None = None) -> str:
    """Where this rank computes: the device its group placed it on (``TPGroup.join``), or the
    configured one for a replica of one rank."""
    joined = [g.device for g in (tp, ep) if g is not None and g.device is not None]
    if not joined:
        return config.device
    if (joined[0] == "cpu") != (config.device == "cpu"):
        raise ValueError(f"device: this rank joined its group on {joined[0]}, but the replica runs on {config.device}; every rank passes the configured device to TPGroup.join")
    return joined[0]


def build_speculator(config: EngineConfig, model_name: str, model_config: ModelConfig, max_model_len: int, num_kv_blocks: int) -> Speculator:
    """The drafting of ``config.speculative``; a draft model must share the target's vocabulary
    and gets as many KV blocks as the target (``num_kv_blocks``)."""
    policy = SpecPolicy(token_cost=config.spec_token_cost, chunk_cost=config.spec_chunk_cost)
    if config.speculative == "ngram":
        proposer = NgramProposer(config.ngram_min_match, config.ngram_max_match)
    else:
        draft_dir = resolve_model(config.draft_model, config.cache_dir)
        draft_mc = ModelConfig.from_dir(draft_dir)
        if draft_mc.vocab_size != model_config.vocab_size:
            raise ValueError(
                f"draft_model: {config.draft_model!r} has a vocabulary of {draft_mc.vocab_size} tokens, "
                f"the model {model_name!r} one of {model_config.vocab_size}; drafts must be the target's tokens"
            )
        draft_config = dataclasses.replace(config, model=config.draft_model, speculative="off", draft_model=None, num_kv_blocks=num_kv_blocks)
        single = TPGroup.single()
        model, kv_cache = build_shard(draft_config, draft_mc, draft_dir, max_model_len, single, single)
        proposer = DraftModelProposer(model, kv_cache)
    return Speculator(proposer, policy, config.num_speculative_tokens)
