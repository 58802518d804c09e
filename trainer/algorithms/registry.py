"""The algorithm registry (one ``record.Algorithm`` per name) and the functions' uniform signatures.

A new algorithm is one module: its options dataclass, its pure functions and one
``register_algorithm(Algorithm(...))``. The loop and the recipe validator look the record
up by ``algorithm.name`` and ask it, never the name (the verl ``core_algos.py`` pattern).
``ADVANTAGES`` / ``POLICY_LOSSES`` are read-only views of the records' functions.

Uniform signatures (every registered function follows one of them):

- advantage estimator: ``fn(batch: AdvantageInputs, cfg) -> Tensor[S, T]``
  per-token advantages, exactly zero where ``batch.mask`` is 0.
- policy loss: ``fn(batch: LossInputs, cfg) -> LossOutput``.

``cfg`` is the algorithm's options object (``Algorithm.options``), duck-typed: each function
documents the attributes it reads. ``S`` = sequences in the (micro-)batch, ``T`` = padded completion length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

import torch

from trainer.algorithms.aggregation import LossNormalizer
from trainer.algorithms.record import Algorithm

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """A name -> function table that refuses duplicates and lists valid names on a miss."""

    def __init__(self, kind: str, accepts: Callable[[Any], bool] = callable, expected: str = "a callable") -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}
        self._accepts, self._expected = accepts, expected

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@ADVANTAGES.register("grpo")``. Raises ValueError on a duplicate name."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} registry: name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._fns:
                # Silent overwrite would let an import order decide which algorithm runs.
                raise ValueError(
                    f"{self.kind} registry: name {name!r} is already registered "
                    f"(by {_origin(self._fns[name])})"
                )
            if not self._accepts(fn):
                raise ValueError(f"{self.kind} registry: {name!r} must register {self._expected}, got {fn!r}")
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError listing the valid names otherwise."""
        try:
            return self._fns[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none registered)'}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def values(self) -> list[F]:
        return [self._fns[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


def _origin(entry: Any) -> str:
    fn = getattr(entry, "advantage", entry)  # a record: where its functions live
    return f"{fn.__module__}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _check_2d(owner: str, name: str, value: torch.Tensor | None, shape: torch.Size) -> None:
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}.{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.shape != shape:
        raise ValueError(f"{owner}.{name} has shape {tuple(value.shape)}, expected {tuple(shape)} [S, T]")


@dataclass
class AdvantageInputs:
    """What an advantage estimator sees.

    rewards: [S] one scalar score per sequence.
    mask: [S, T] 1 (or True) on completion tokens, 0 on padding.
    group_size: completions per prompt; samples are group-contiguous (sample ``i``
        answers prompt ``i // group_size``), as produced by ``rollout.types.Rollouts``.
    values: [S, T] optional critic values (PPO/GAE).
    token_rewards: [S, T] optional per-token rewards (PPO/GAE, KL-in-reward).
    all_sum: with data parallel, sums a tensor over the ranks (``DataParallel.all_sum``):
        estimators with batch-level statistics (whitening) use it so that each rank's
        shard gets the whole batch's; None = these rows are the whole batch. Group
        statistics need none: a group never spans two ranks.
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    group_size: int
    values: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    all_sum: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.mask.dim() != 2:
            raise ValueError(f"AdvantageInputs.mask must be 2-D [S, T], got shape {tuple(self.mask.shape)}")
        s = self.mask.shape[0]
        if self.rewards.shape != (s,):
            raise ValueError(
                f"AdvantageInputs.rewards has shape {tuple(self.rewards.shape)}, expected ({s},) [S] to match mask"
            )
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"AdvantageInputs.group_size must be an int >= 1, got {self.group_size!r}")
        if s % self.group_size:
            raise ValueError(
                f"AdvantageInputs: {s} sequences is not a multiple of group_size={self.group_size}"
            )
        _check_2d("AdvantageInputs", "values", self.values, self.mask.shape)
        _check_2d("AdvantageInputs", "token_rewards", self.token_rewards, self.mask.shape)


@dataclass
class LossInputs:
    """What a policy loss sees: one micro-batch of whole sequences.

    logprobs: [S, T] current policy's log-prob of each sampled token (requires grad).
    old_logprobs: [S, T] log-probs under the policy that produced the data (treated as constants).
    advantages: [S, T] per-token advantages (constants).
    mask: [S, T] 1 (or True) on completion tokens, 0 on padding. Values of the other
        tensors at padding are ignored, even if NaN/inf.
    normalizer: the GLOBAL denominators of the whole rollout batch (see
        ``aggregation.LossNormalizer``), so micro-batch losses sum to the full-batch loss.
    ref_logprobs: [S, T] optional reference policy log-probs for a KL penalty (constants).
    is_weights: [S, T] optional rollout->trainer correction weights (parity.corrections; constants)
        multiplying the per-token loss.
    behaviour_logprobs: [S, T] optional log-probs of the policy that sampled the tokens (the engine's; constants).
        When given, the KL penalty takes its unbiased form: its per-token k3 weighted by
        pi_theta / pi_behaviour (``kl.behaviour_ratio``, with gradient) instead of by ``is_weights``.
    values: [S, T] optional current critic values V (requires grad; PPO's value loss).
    old_values: [S, T] optional critic values when the data was collected (constants; the
        centre of PPO's value clip).
    returns: [S, T] optional value targets R, e.g. GAE advantages + old values (constants).
    entropy: [S, T] optional per-token policy entropy (requires grad; PPO's entropy bonus).
    Losses that need an optional field raise a ValueError naming it when it is None.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    normalizer: LossNormalizer
    ref_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.logprobs.dim() != 2:
            raise ValueError(f"LossInputs.logprobs must be 2-D [S, T], got shape {tuple(self.logprobs.shape)}")
        shape = self.logprobs.shape
        for name in ("old_logprobs", "advantages", "mask", "ref_logprobs", "is_weights", "behaviour_logprobs",
                     "values", "old_values", "returns", "entropy"):
            _check_2d("LossInputs", name, getattr(self, name), shape)
        if not isinstance(self.normalizer, LossNormalizer):
            raise TypeError(
                f"LossInputs.normalizer must be a LossNormalizer, got {type(self.normalizer).__name__}"
            )


@dataclass
class LossOutput:
    """A policy loss's result for one micro-batch.

    loss: scalar tensor to call ``.backward()`` on.
    metrics: floats under ``train/``. Every metric is this micro-batch's CONTRIBUTION
        under the global normaliser, so summing a key over the micro-batches (and ranks)
        of one optimizer step gives the full-batch value -- the same rule as ``loss``.
    """

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


ALGORITHMS: Registry[Algorithm] = Registry("algorithm", accepts=lambda r: isinstance(r, Algorithm),
                                             expected="a record.Algorithm")


def register_algorithm(record: Algorithm) -> Algorithm:
    """Register ``record`` under its name; a duplicate name is refused (import order must not pick one)."""
    return ALGORITHMS.register(record.name)(record)


class _FunctionView:
    """``ADVANTAGES.get(name)`` / ``POLICY_LOSSES.get(name)``: one function of each record, read-only."""

    def __init__(self, kind: str, attr: str) -> None:
        self.kind, self._attr = kind, attr

    def get(self, name: str) -> Callable[..., Any]:
        if name not in ALGORITHMS:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none registered)'}")
        return getattr(ALGORITHMS.get(name), self._attr)

    def names(self) -> list[str]:
        return ALGORITHMS.names()

    def __contains__(self, name: object) -> bool:
        return name in ALGORITHMS


ADVANTAGES = _FunctionView("advantage estimator", "advantage")
POLICY_LOSSES = _FunctionView("policy loss", "loss")
