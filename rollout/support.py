"""The support a truncated sampler drew each token from: at every completion position, the token ids top-k, top-p
and min-p kept (DESIGN.md, "The sampled support").

With truncation the engine samples from softmax over the kept set S only, and its processed log-probs are
normalised over S; the trainer normalises its own log-probs over exactly the same S (``parity.logprobs``:
``support``), so that both sides are log-probs of one distribution family. S is the engine's own record of what it
kept, never recomputed from the trainer's logits: near a tie at the top-p boundary the two sides' logits can order
tokens differently, and a recomputed set would differ from the one sampled from.

One sample's support is a CSR pair: ``ids`` (int32, every position's kept ids, position after position) and
``offsets`` (int64, ``[C + 1]``: position c's ids are ``ids[offsets[c]:offsets[c + 1]]``). A position the engine did
not sample (a multi-turn episode's environment reply) has an empty set. vLLM's own ``SamplingMaskLists``
(``vllm/v1/outputs.py``) has the same layout.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = ["Support", "check_supports", "decode_supports", "encode_supports"]


@dataclass(frozen=True)
class Support:
    """One sample's kept sets, position by position."""

    ids: torch.Tensor  # int32 [M]
    offsets: torch.Tensor  # int64 [C + 1], offsets[0] = 0, non-decreasing, offsets[-1] = M

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.offsets.dim() != 1 or self.offsets.numel() < 1:
            raise ValueError(f"Support: ids [M] and offsets [C + 1] expected, got {tuple(self.ids.shape)} and "
                             f"{tuple(self.offsets.shape)}")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.ids.numel() or \
                bool((self.offsets[1:] < self.offsets[:-1]).any()):
            raise ValueError("Support: offsets must start at 0, never decrease and end at len(ids)")

    @classmethod
    def from_lists(cls, sets: Sequence[Sequence[int]]) -> "Support":
        """From one list of kept ids per position."""
        sizes = torch.tensor([len(s) for s in sets], dtype=torch.long)
        offsets = torch.zeros(len(sets) + 1, dtype=torch.long)
        offsets[1:] = sizes.cumsum(0)
        flat = [t for s in sets for t in s]
        return cls(torch.tensor(flat, dtype=torch.int32), offsets)

    @classmethod
    def empty(cls, positions: int) -> "Support":
        """``positions`` empty sets (context positions)."""
        return cls(torch.zeros(0, dtype=torch.int32), torch.zeros(positions + 1, dtype=torch.long))

    @classmethod
    def concat(cls, parts: Iterable["Support"]) -> "Support":
        """The positions of ``parts``, one after the other (an episode's turns and replies)."""
        parts = list(parts)
        if not parts:
            return cls.empty(0)
        shifts = torch.tensor([0] + [p.ids.numel() for p in parts[:-1]], dtype=torch.long).cumsum(0)
        offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)])
        return cls(torch.cat([p.ids for p in parts]), offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def sizes(self) -> torch.Tensor:
        """[C] the kept set's size at each position (0 at a context position)."""
        return self.offsets[1:] - self.offsets[:-1]

    def positions(self, lo: int, hi: int) -> "Support":
        """Positions ``lo`` to ``hi`` (exclusive)."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        return Support(self.ids[a:b], self.offsets[lo:hi + 1] - a)

    def mask(self, vocab: int) -> torch.Tensor:
        """bool [C, vocab]: True where a token is in its position's kept set."""
        keep = torch.zeros(len(self), vocab, dtype=torch.bool)
        keep[torch.repeat_interleave(torch.arange(len(self)), self.sizes), self.ids.long()] = True
        return keep

    def to_lists(self) -> list[list[int]]:
        o = self.offsets.tolist()
        ids = self.ids.tolist()
        return [ids[o[c]:o[c + 1]] for c in range(len(self))]

    def holds(self, tokens: Sequence[int], sampled: Sequence[int] | None = None) -> list[int]:
        """The positions (of those ``sampled`` marks 1, default all) whose token is not in its kept set."""
        rows = torch.repeat_interleave(torch.arange(len(self)), self.sizes)
        tok = torch.as_tensor(list(tokens), dtype=torch.long)
        hit = torch.zeros(len(self), dtype=torch.long)
        if self.ids.numel():
            hit.index_add_(0, rows, (self.ids.long() == tok[rows]).long())
        want = torch.ones(len(self), dtype=torch.bool) if sampled is None else torch.as_tensor(list(sampled)) > 0
        return (want & (hit == 0)).nonzero().squeeze(1).tolist()


def check_supports(supports: Sequence[Support], completions: Sequence[Sequence[int]],
                   masks: Sequence[Sequence[int]] | None, what: str) -> None:
    """One support per sample, one set per completion position, every sampled token inside its set."""
    if len(supports) != len(completions):
        raise ValueError(f"{what}: {len(supports)} supports for {len(completions)} samples")
    for i, (s, c) in enumerate(zip(supports, completions)):
        if len(s) != len(c):
            raise ValueError(f"{what}: sample {i} has {len(c)} completion tokens but {len(s)} kept sets")
        outside = s.holds(c, None if not masks else masks[i])
        if outside:
            raise ValueError(f"{what}: sample {i}: the sampled token at positions {outside[:5]} is not in the set the "
                             "engine says it sampled from")


def encode_supports(supports: Sequence[Support]) -> list[dict]:
    """JSON-ready (a prefetched batch in a checkpoint, an answer over the wire): base64 of ids and offsets."""
    return [{"ids": base64.b64encode(s.ids.numpy().tobytes()).decode("ascii"),
             "offsets": base64.b64encode(s.offsets.numpy().tobytes()).decode("ascii")} for s in supports]


def decode_supports(encoded: Sequence[dict]) -> list[Support]:
    def tensor(text: str, dtype) -> torch.Tensor:
        raw = base64.b64decode(text)
        return torch.frombuffer(bytearray(raw), dtype=dtype).clone() if raw else torch.zeros(0, dtype=dtype)

    return [Support(tensor(e["ids"], torch.int32), tensor(e["offsets"], torch.long)) for e in encoded]
