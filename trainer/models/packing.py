"""Packed rows: several sequences of a micro-batch concatenated into one row, so the backbone computes no padding.

A ``TokenBatch`` row is a left-padded prompt and a right-padded completion; packing moves
each row's real tokens (one contiguous run) into rows of ``capacity`` tokens (the
micro-batch's longest sequence), first-fit by decreasing length, with ``position_ids``
restarting at 0 at each sequence's first token, as in the padded row. No
``attention_mask`` is passed: transformers then reads the sequence boundaries from the
position ids (``masking_utils.find_packed_sequence_indices``: a new sequence wherever
the position does not grow by 1) and ANDs a same-sequence mask into the causal (and
sliding-window) mask, for sdpa, eager and flex attention. Its flash-attention path
detects packing only in a batch of ONE row (``modeling_flash_attention_utils
._is_packed_sequence``), so with several rows its sequences would attend across each
other: ``packing_error`` refuses it, as any model whose forward does not honour the
boundaries (measured, not assumed from the architecture's name).

Padding left at the end of a row gets positions 0, 1, ... of its own, so it is a
sequence of its own that no real token attends to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.models.batch import TokenBatch, build_token_batch
from trainer.models.routing_replay import PAD


@dataclass
class PackedRows:
    """input_ids, position_ids: [R, capacity]; ``source`` [S, C]: the flat index (into R * capacity) of the
    position whose hidden state predicts each target of the padded batch (0 where the mask is 0);
    ``routes`` [R, capacity, L, k]: the batch's routes moved with their tokens (PAD elsewhere), or None."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    source: torch.Tensor
    routes: torch.Tensor | None = None


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequences (indices into ``lengths``) per row: first fit by decreasing length, each row <= ``capacity``."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for r, used in enumerate(fill):
            if used + lengths[i] <= capacity:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return rows


def pack(batch: TokenBatch, capacity: int | None = None) -> PackedRows:
    """The packed rows of ``batch`` (see the module docstring); ``capacity`` default: the longest sequence.

    Rows as long as the longest sequence keep the attention cost of the padded layout (sdpa
    and eager compute every query x key pair of a row, then mask): packing removes the
    padding without making any row longer.
    """
    am = batch.attention_mask
    lengths = am.sum(1).tolist()
    starts = am.argmax(1).tolist()  # each row's real tokens are one run: its first 1
    capacity = max(lengths) if capacity is None else capacity
    rows = first_fit(lengths, capacity)
    s, c = batch.targets.shape
    device = batch.input_ids.device
    input_ids = torch.zeros((len(rows), capacity), dtype=batch.input_ids.dtype, device=device)
    position_ids = torch.zeros((len(rows), capacity), dtype=batch.position_ids.dtype, device=device)
    base = torch.zeros(s, dtype=torch.long)  # flat index of each sequence's column 0 of the padded row
    routes = None if batch.routes is None else torch.full((len(rows), capacity, *batch.routes.shape[2:]), PAD,
                                                          dtype=batch.routes.dtype, device=device)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n, start = lengths[i], starts[i]
            input_ids[r, col:col + n] = batch.input_ids[i, start:start + n]
            if routes is not None:
                routes[r, col:col + n] = batch.routes[i, start:start + n]
            position_ids[r, col:col + n] = torch.arange(n, device=device)
            base[i] = r * capacity + col - start
            col += n
        position_ids[r, col:] = torch.arange(capacity - col, device=device)
    # padded column P-1+j predicts target j
    source = base[:, None] + (batch.prompt_len - 1) + torch.arange(c)[None, :]
    source = torch.where(batch.mask.cpu() > 0, source, torch.zeros_like(source))
    return PackedRows(input_ids, position_ids, source.to(device), routes)


def unpack(packed_out: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Per-position outputs [R, capacity, ...] -> [S, C, ...] at the positions that predict the targets."""
    flat = packed_out.reshape(-1, *packed_out.shape[2:])
    return flat[packed.source]


def packing_error(backbone, *, vocab_size: int) -> float:
    """Largest |difference| of the hidden states that predict completion tokens between three sequences packed
    into two rows and the same sequences padded in three: ~1e-6 in float32 when the forward honours the
    sequence boundaries, O(0.1) when tokens attend across them."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(1, vocab_size, (n,), generator=g).tolist()

    # lengths 9, 5, 3: rows [9] and [5, 3, one padding token] (capacity 9)
    batch = build_token_batch([ids(5), ids(2), ids(1)], [ids(4), ids(3), ids(2)], pad_id=0,
                              device=next(backbone.parameters()).device)
    packed = pack(batch)
    with torch.no_grad():
        padded = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, use_cache=False).last_hidden_state
        joined = backbone(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
                          use_cache=False).last_hidden_state
    p, c = batch.prompt_len, batch.targets.shape[1]
    diff = (unpack(joined, packed) - padded[:, p - 1:p - 1 + c]).abs() * batch.mask[..., None]
    return float(diff.max())
