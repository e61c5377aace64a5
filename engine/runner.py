"""Build one step's flat token batch from scheduled chunks, run the model, sample.

Decode tokens come first in the flat batch, then prefill chunks. Decode sequences are sorted by
context length and cut into groups whose padded width stays close to their real width, so a
single long sequence does not make every short one attend over padding.
"""

from __future__ import annotations

import torch

from engine.kv_cache import PagedKVCache
from engine.layers.attention import AttentionBatch, DecodeGroup, PrefillChunk
from engine.models.decoder import DecoderModel
from engine.request import Request
from engine.sampler import sample
from engine.scheduler import ScheduledChunk

_GROUP_GROWTH = 1.25
"""A decode group closes when the next sequence would need this many times its first one's blocks."""


class ModelRunner:
    """Owns the model and the KV tensors; turns scheduled chunks into sampled tokens."""

    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.dtype = model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> dict[Request, int]:
        decodes = sorted((c for c in chunks if c.num_new_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block_ids: list[int] = []
        sampling: list[ScheduledChunk] = []
        rows: list[int] = []
        for chunk in ordered:
            request, start, end = chunk.request, chunk.start, chunk.start + chunk.num_new_tokens
            input_ids += request.token_ids[start:end]
            positions += range(start, end)
            slot_block_ids += (request.block_ids[p // self.block_size] for p in range(start, end))
            if chunk.samples:
                sampling.append(chunk)
                rows.append(len(positions) - 1)
        position_t = torch.tensor(positions, dtype=torch.long)
        cos, sin = self.model.rotary.tables(position_t, self.dtype)
        config = self.model.config
        new_kv_shape = (len(positions), config.num_layers, config.num_kv_heads, config.head_dim)
        batch = AttentionBatch(
            kv_cache=self.kv_cache,
            rope_cos=cos,
            rope_sin=sin,
            decode_groups=self._decode_groups(decodes),
            prefill_chunks=self._prefill_chunks(prefills, first_token=len(decodes)),
            new_k=torch.empty(new_kv_shape, dtype=self.dtype),
            new_v=torch.empty(new_kv_shape, dtype=self.dtype),
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long), batch)
        block_ids = torch.tensor(slot_block_ids, dtype=torch.long)
        self.kv_cache.write(batch.new_k, batch.new_v, block_ids, position_t % self.block_size)

        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        requests = [c.request for c in sampling]
        tokens = sample(logits, [r.params for r in requests], [r.seed for r in requests], [r.num_output_tokens for r in requests])
        return {c.request: t for c, t in zip(sampling, tokens)}

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> tuple[DecodeGroup, ...]:
        groups: list[list[tuple[int, ScheduledChunk]]] = []
        for index, chunk in enumerate(decodes):
            num_blocks = chunk.start // self.block_size + 1
            if not groups or num_blocks > _GROUP_GROWTH * (groups[-1][0][1].start // self.block_size + 1):
                groups.append([])
            groups[-1].append((index, chunk))
        return tuple(self._decode_group(g) for g in groups)

    def _decode_group(self, members: list[tuple[int, ScheduledChunk]]) -> DecodeGroup:
        width = members[-1][1].start // self.block_size + 1
        tables = torch.empty(len(members), width, dtype=torch.long)
        for row, (_, chunk) in enumerate(members):
            blocks = chunk.request.block_ids[: chunk.start // self.block_size + 1]
            tables[row] = torch.tensor(blocks + [blocks[0]] * (width - len(blocks)))
        positions = torch.tensor([chunk.start for _, chunk in members], dtype=torch.long)
        key_positions = torch.arange(width * self.block_size)
        mask = (key_positions[None, :] <= positions[:, None])[:, None, None, :]
        tokens = slice(members[0][0], members[-1][0] + 1)
        return DecodeGroup(tokens=tokens, rows=torch.arange(len(members)), positions=positions, block_tables=tables, mask=mask)

    def _prefill_chunks(self, prefills: list[ScheduledChunk], first_token: int) -> tuple[PrefillChunk, ...]:
        out = []
        token_start = first_token
        for chunk in prefills:
            end = chunk.start + chunk.num_new_tokens
            num_blocks = -(-end // self.block_size)
            table = torch.tensor([chunk.request.block_ids[:num_blocks]], dtype=torch.long)
            query_positions = torch.arange(chunk.start, end)
            key_positions = torch.arange(num_blocks * self.block_size)
            mask = key_positions[None, :] <= query_positions[:, None]
            out.append(PrefillChunk(token_start, chunk.num_new_tokens, chunk.start, table, mask))
            token_start += chunk.num_new_tokens
        return tuple(out)
