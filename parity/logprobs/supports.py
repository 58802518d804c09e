"""A truncated sampler's kept sets (``fused_logprobs``'s ``support``; package docstring) over the kernel's rows."""

from __future__ import annotations

import torch


class _KeptSets:
    """A truncated sampler's kept sets over the kernel's rows (CSR), and their boolean tiles."""

    def __init__(self, offsets: torch.Tensor, ids: torch.Tensor, vocab: int) -> None:
        self.offsets, self.ids, self.vocab = offsets, ids, vocab
        sizes = offsets[1:] - offsets[:-1]
        self.row_of = torch.repeat_interleave(torch.arange(sizes.numel(), device=ids.device), sizes)

    @classmethod
    def of(cls, support, n: int, vocab: int, device) -> "_KeptSets":
        if not (isinstance(support, (tuple, list)) and len(support) == 2):
            raise ValueError("support: expected (offsets [N + 1], ids [M])")
        offsets, ids = (torch.as_tensor(x, device=device) for x in support)
        if offsets.dim() != 1 or offsets.numel() != n + 1 or ids.dim() != 1:
            raise ValueError(f"support: offsets must be [N + 1] = [{n + 1}] and ids [M], got "
                             f"{tuple(offsets.shape)} and {tuple(ids.shape)}")
        offsets, ids = offsets.long(), ids.long()
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("support: offsets must start at 0, never decrease and end at len(ids)")
        if ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
            raise ValueError(f"support: ids outside [0, {vocab})")
        return cls(offsets, ids, vocab)

    def rows(self, idx: torch.Tensor) -> "_KeptSets":
        """The sets of rows ``idx``, in that order."""
        sizes = (self.offsets[1:] - self.offsets[:-1])[idx]
        offsets = torch.zeros(idx.numel() + 1, dtype=torch.long, device=idx.device)
        offsets[1:] = sizes.cumsum(0)
        within = torch.arange(int(offsets[-1]), device=idx.device) - torch.repeat_interleave(offsets[:-1], sizes)
        return _KeptSets(offsets, self.ids[torch.repeat_interleave(self.offsets[idx], sizes) + within], self.vocab)

    def check_targets(self, targets: torch.Tensor) -> None:
        hit = torch.zeros(targets.numel(), dtype=torch.long, device=targets.device)
        hit.index_add_(0, self.row_of, (self.ids == targets[self.row_of]).long())
        missing = (hit == 0).nonzero().squeeze(1)
        if missing.numel():
            raise ValueError(f"support: {missing.numel()} target(s) outside their kept set (first at valid position "
                             f"{int(missing[0])}): a token must be sampled from the set it is normalised over")

    def tile(self, r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        """bool [r1 - r0, v1 - v0]: True where the vocabulary entry is in the row's set."""
        keep = torch.zeros(r1 - r0, v1 - v0, dtype=torch.bool, device=self.ids.device)
        a, b = int(self.offsets[r0]), int(self.offsets[r1])
        ids, rows = self.ids[a:b], self.row_of[a:b]
        inside = (ids >= v0) & (ids < v1)
        keep[rows[inside] - r0, ids[inside] - v0] = True
        return keep
