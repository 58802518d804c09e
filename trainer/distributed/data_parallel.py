"""Data parallel over N processes, each with its own colocated engine: sharding, gradient and metric reduction.

Launch: ``torchrun --nproc_per_node N -m trainer.train <recipe>`` (CPU: gloo; GPU: NCCL for CUDA tensors and gloo
for CPU ones, ``trainer.distributed.process_group``; ``accelerate launch --num_processes N`` on GPUs). Every rank reads the same prompt stream
(same seed), keeps its contiguous slice of whole prompts -- so a GRPO group never spans
two ranks -- and samples them on its own engine with the sample seeds a single process
would use for those samples (``SamplingSpec.index_offset``). Rewards and group
advantages are local. Gradients:

* the loss of every rank is normalised by the GLOBAL token / sequence counts
  (``global_normalizer``: an all-reduce of the local counts), so the sum of the ranks'
  gradients is the gradient of one process holding the whole batch;
* after backward, ``all_reduce_grads`` sums the gradients (one flat bucket per dtype).

Why not DDP's wrapper: the policy's forward calls the backbone and the fused log-prob
kernel directly (never the wrapper's ``forward``), so DDP's reducer would not be armed
(``prepare_for_backward`` runs in ``DistributedDataParallel.forward``). One explicit
all-reduce per optimizer step is what DDP would do anyway, without bucket overlap.

Metrics: ``pooled_parity`` all-reduces ``parity.metrics.sufficient_stats`` (sums and
maxima, with ``parity.metrics.reduction``) and finalizes once: token-weighted means, a
global max, Pearson from pooled sums -- never a mean of per-rank correlations. Loss
metrics are micro-batch contributions under the global normaliser and are summed.
Per-sample means (reward, lengths) are averaged (every rank holds the same number of
samples). Batch-level statistics are pooled: REINFORCE++'s and PPO's whitening and PPO's
adaptive KL controller see the whole batch through ``all_sum`` (``AdvantageInputs.all_sum``).

With one process every function here is the identity (no torch.distributed call).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from parity.metrics import finalize, reduction, sufficient_stats
from trainer.algorithms import LossNormalizer
from trainer.distributed.process_group import check_serves_cpu


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    world: int = 1
    # False under DeepSpeed: its engine reduces the gradients (into ZeRO partitions) in
    # engine.backward / engine.step, so all_reduce_grads must not sum them a second time.
    reduce_grads: bool = True

    @classmethod
    def current(cls, reduce_grads: bool = True) -> "DataParallel":
        d = torch.distributed
        if d.is_available() and d.is_initialized() and d.get_world_size() > 1:
            check_serves_cpu()  # the reductions below are on CPU tensors (trainer/distributed/process_group.py)
            return cls(rank=d.get_rank(), world=d.get_world_size(), reduce_grads=reduce_grads)
        return cls(reduce_grads=reduce_grads)

    @property
    def active(self) -> bool:
        return self.world > 1

    def shard(self, rows: list, what: str = "prompts_per_step") -> list:
        """This rank's contiguous share of ``rows`` (the whole list with one process)."""
        if len(rows) % self.world:
            raise ValueError(f"rollout.{what} = {len(rows)} is not divisible by the {self.world} processes; "
                             "every rank must hold the same number of whole prompts")
        k = len(rows) // self.world
        return rows[self.rank * k:(self.rank + 1) * k]

    def offset(self, local_count: int) -> int:
        """Global index of this rank's first item when every rank holds ``local_count``."""
        return self.rank * local_count

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.active:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (a new tensor; ``t`` itself with one process). Collective."""
        return self._all_reduce(t.clone()) if self.active else t

    def global_normalizer(self, mask: torch.Tensor, max_len: int) -> LossNormalizer:
        """``LossNormalizer`` of the whole (all ranks') rollout batch."""
        valid = mask != 0
        counts = torch.tensor([valid.sum().item(), valid.any(dim=-1).sum().item()], dtype=torch.float64)
        self._all_reduce(counts)
        return LossNormalizer(num_tokens=float(counts[0]), num_seqs=float(counts[1]), max_len=max_len)

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every gradient over the ranks, one flat buffer per dtype/device (missing grads count as 0).

        No-op with one process or when ``reduce_grads`` is false (DeepSpeed reduces them).
        """
        if not self.active or not self.reduce_grads:
            return
        groups: dict[tuple, list[torch.nn.Parameter]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for ps in groups.values():
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            self._all_reduce(flat)
            i = 0
            for p in ps:
                n = p.grad.numel()
                p.grad.copy_(flat[i:i + n].view_as(p.grad))
                i += n

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sum each value over the ranks (every rank must pass the same keys)."""
        return self._reduce_dict(metrics, mean=False)

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average each value over the ranks (every rank must pass the same keys)."""
        return self._reduce_dict(metrics, mean=True)

    def max_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The largest value of each key over the ranks (a minimum: pass its negation)."""
        return self._reduce_dict(metrics, mean=False, op=torch.distributed.ReduceOp.MAX if self.active else None)

    def _reduce_dict(self, metrics: dict[str, float], mean: bool, op=None) -> dict[str, float]:
        if not self.active or not metrics:
            return dict(metrics)
        keys = sorted(metrics)
        t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        self._all_reduce(t, op)
        if mean:
            t /= self.world
        return dict(zip(keys, t.tolist()))

    def pooled_stats(self, train_logprobs, rollout_logprobs, mask, *, train_topk_logprobs=None,
                     rollout_topk_logprobs=None) -> dict:
        """``parity.metrics.sufficient_stats`` summed (maxed) over every rank's tokens."""
        stats = sufficient_stats(train_logprobs, rollout_logprobs, mask > 0, train_topk_logprobs=train_topk_logprobs,
                                 rollout_topk_logprobs=rollout_topk_logprobs)
        if self.active:
            for key in sorted(stats):
                op = torch.distributed.ReduceOp.MAX if reduction(key) == "max" else torch.distributed.ReduceOp.SUM
                stats[key] = self._all_reduce(stats[key].double().clone(), op)
        return stats

    def pool(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Statistics summed over the ranks, those whose key ends in ``_max`` maxed (``parity.corrections.reduction``,
        the rule of ``parity.metrics.reduction`` too): one all-reduce per operation for the whole dict. Collective:
        every rank passes the same keys and shapes."""
        if not self.active:
            return dict(stats)
        out = {}
        for op in ("sum", "max"):
            keys = sorted(k for k in stats if reduction(k) == op)
            if not keys:
                continue
            flat = torch.cat([stats[k].double().reshape(-1) for k in keys])
            self._all_reduce(flat, torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
            i = 0
            for k in keys:
                n = stats[k].numel()
                out[k] = flat[i:i + n].view(stats[k].shape)
                i += n
        return out

    def pooled_parity(self, train_logprobs, rollout_logprobs, mask, *, train_topk_logprobs=None,
                      rollout_topk_logprobs=None, prefix: str = "parity/") -> dict[str, float]:
        """``parity.metrics.compare`` over the union of every rank's tokens (exact pooling)."""
        out = finalize(self.pooled_stats(train_logprobs, rollout_logprobs, mask, train_topk_logprobs=train_topk_logprobs,
                                         rollout_topk_logprobs=rollout_topk_logprobs))
        return out if prefix == "parity/" else {prefix + k.split("/", 1)[1]: v for k, v in out.items()}

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` in rank order, on every rank (picklable objects); [obj] without data parallel."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` as rank ``src`` holds it, on every rank (picklable objects)."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def raise_together(self, error: BaseException | None) -> None:
        """Collective: if any rank passes an error, every rank raises (this rank's own error, or a
        RuntimeError naming the failed ranks), instead of the others waiting in their next collective."""
        if not self.active:
            if error is not None:
                raise error
            return
        flags = torch.zeros(self.world, dtype=torch.float64)
        flags[self.rank] = float(error is not None)
        self._all_reduce(flags)
        if error is not None:
            raise error
        failed = [r for r in range(self.world) if flags[r]]
        if failed:
            raise RuntimeError(f"data-parallel rank(s) {failed} failed (their error is in their own output); "
                               f"rank {self.rank} stops with them")

