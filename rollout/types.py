"""The typed hand-off from a rollout engine to the trainer.

`trainer/` only ever sees these containers, never an engine's own objects.
Samples are laid out group-contiguous: sample ``i`` answers prompt
``i // n`` where ``n`` is ``SamplingSpec.n``, so a GRPO group is a slice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from rollout.routes import check_routes
from rollout.support import check_supports


def group_sample_indices(groups: Sequence[int], group_size: int) -> list[int]:
    """Sample indices of the given groups (prompt indices), in that order: groups are contiguous."""
    return [gi * group_size + j for gi in groups for j in range(group_size)]


@dataclass(frozen=True)
class SamplingSpec:
    """What the engine samples with. The trainer scores with the same temperature.

    n: completions per prompt (the GRPO group size).
    temperature: > 0. Engines return log-probs *after* temperature scaling,
        i.e. log softmax(logits / temperature) of the sampled token.
    top_p, top_k, min_p: 1.0 / 0 / 0.0 mean off. With any of them on the engine also returns the set of tokens it
        kept at every sampled position (``Rollouts.support``), over which its log-probs are normalised.
    max_new_tokens: completion length cap; finish_reason "length" when hit.
    seed: base seed; an engine derives per-request seeds from it so that a
        run is reproducible given the same weights.
    logprobs_topk: k > 0 also returns, per completion position, the engine's k most
        likely token ids and their (processed) log-probs: the input of the top-k KL
        (``parity.metrics.topk_kl``). 0 = off.
    index_offset: global index of this call's first sample. Seeds derive from
        (seed, index_offset + local index), so a data-parallel rank sampling its shard
        draws exactly what one process sampling the whole batch would for those samples.
    sample_indices: instead of ``index_offset + s``, the global index of each sample s (prompt i's j-th sample
        is s = i * n + j) when a call's samples are not numbered contiguously: a multi-turn step's turn holds the
        episodes still live, each keeping its own index (trainer/sampling/episodes.py). Empty: ``index_offset + s``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    logprobs_topk: int = 0
    index_offset: int = 0
    sample_indices: tuple[int, ...] = ()

    @property
    def truncated(self) -> bool:
        """Whether top-k, top-p or min-p leave out part of the vocabulary, so that the engine's log-probs are over
        the set it kept. top-k 1 alone is greedy decoding (a held-out evaluation's): its log-probs are not
        compared, so it needs no kept sets."""
        return self.top_p < 1.0 or self.top_k > 1 or self.min_p > 0.0

    def sample_index(self, s: int) -> int:
        """The global index of this call's sample ``s`` (the per-sample seed derives from it)."""
        return self.sample_indices[s] if self.sample_indices else self.index_offset + s


@dataclass(frozen=True)
class ImageInput:
    """One image as the engine consumed it: the fingerprint of its pixel tensor (``parity.input_digest``, in the
    dtype the engine ran it in), that tensor's shape, and the placeholder span of the expanded prompt it fills
    (``offset``: the span's first position, ``length``: its positions, markers included)."""

    digest: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    length: int


@dataclass
class Rollouts:
    """A batch of sampled completions.

    prompt_ids: [S][P_i] token ids of the prompt each sample answers (repeated per sample).
    completion_ids: [S][C_i] sampled token ids (the EOS token, if sampled, included).
    rollout_logprobs: [S][C_i] float log-prob of each sampled token under the
        engine's (temperature-scaled) distribution.
    finish_reasons: [S] "stop" (EOS / stop token) or "length" (hit max_new_tokens).
    group_size: n; len(samples) == num_prompts * group_size.
    completion_texts: [S] decoded completions, if the engine has a tokenizer (else empty).
    topk_ids, topk_logprobs: [S][C_i][k] the engine's k most likely tokens at each
        completion position and their log-probs (same distribution as
        rollout_logprobs), most likely first; empty lists unless
        ``SamplingSpec.logprobs_topk`` = k > 0.
    completion_mask: [S][C_i] 1 where the engine sampled the token, 0 where the token is context
        the engine was given inside the completion (a multi-turn episode's environment replies
        and the chat template's turn boundaries: DESIGN.md, "Episodes"); only sampled tokens enter
        the loss, the advantages, the KL terms and the parity metrics, and a context token's
        rollout_logprobs entry is 0.0. Empty: every completion token was sampled (single turn).
    routes: [S] an MoE model's routes, one int16 tensor [P_i + C_i, MoE layers, top_k] per sample over its
        prompt and completion (``rollout.routes``: the expert ids the engine's routers chose, -1 where none);
        empty unless the engine was asked for them.
    support: [S] with top-k / top-p / min-p, the set of token ids the engine kept at every completion position
        (``rollout.support.Support``; an empty set at a context position), the sampled token always inside it;
        empty when sampling was not truncated.
    versions: [S][C_i] the engine's weight version that sampled each token (``rollout.in_flight``: weights can change
        in the middle of a generation; a context token carries the version of the sampled token before it, or of the
        first one after it at the completion's start). Empty: every token of the batch came from the weights it was
        launched with. The engine's own numbering (a server: its pushes); the trainer maps it to policy versions.
    stale_kv: [S][C_i] 1 where the token was sampled over KV that older weights computed (``in_flight: keep``
        continues a request on the KV of the weights it started with), else 0. Empty: none was.
    images: [S] a vision-language prompt's images as the engine consumed them (``ImageInput``, in placeholder order;
        an empty list for a text-only prompt); ``prompt_ids`` are then the ids the engine expanded. Empty: no
        prompt of the batch came with images.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    finish_reasons: list[str]
    group_size: int
    completion_texts: list[str] = field(default_factory=list)
    topk_ids: list[list[list[int]]] = field(default_factory=list)
    topk_logprobs: list[list[list[float]]] = field(default_factory=list)
    completion_mask: list[list[int]] = field(default_factory=list)
    routes: list = field(default_factory=list)
    support: list = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    stale_kv: list[list[int]] = field(default_factory=list)
    images: list[list[ImageInput]] = field(default_factory=list)

    def __post_init__(self) -> None:
        s = len(self.completion_ids)
        for name in ("prompt_ids", "rollout_logprobs", "finish_reasons"):
            if len(getattr(self, name)) != s:
                raise ValueError(f"Rollouts.{name} has {len(getattr(self, name))} entries, expected {s}")
        for i, (c, lp) in enumerate(zip(self.completion_ids, self.rollout_logprobs)):
            if len(c) != len(lp):
                raise ValueError(f"Rollouts sample {i}: {len(c)} completion tokens but {len(lp)} log-probs")
        if self.topk_ids or self.topk_logprobs:
            self._check_topk()
        if self.completion_mask:
            self._check_completion_mask()
        if self.routes:
            check_routes(self.routes, [len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids)],
                         "Rollouts.routes")
        if self.support:
            check_supports(self.support, self.completion_ids, self.completion_mask, "Rollouts.support")
        for name in ("versions", "stale_kv"):
            rows = getattr(self, name)
            if rows and (len(rows) != s or any(len(r) != len(c) for r, c in zip(rows, self.completion_ids))):
                raise ValueError(f"Rollouts.{name} must hold one entry per completion token of every sample")
        if self.images and len(self.images) != s:
            raise ValueError(f"Rollouts.images has {len(self.images)} samples, expected {s}")
        if self.group_size < 1 or s % self.group_size:
            raise ValueError(f"Rollouts: {s} samples is not a multiple of group_size={self.group_size}")

    def _check_topk(self) -> None:
        if len(self.topk_ids) != len(self) or len(self.topk_logprobs) != len(self):
            raise ValueError(f"Rollouts.topk_ids / topk_logprobs have {len(self.topk_ids)} / {len(self.topk_logprobs)} "
                             f"samples, expected {len(self)}")
        k = self.topk
        for i, (c, ids, lps) in enumerate(zip(self.completion_ids, self.topk_ids, self.topk_logprobs)):
            if len(ids) != len(c) or len(lps) != len(c):
                raise ValueError(f"Rollouts sample {i}: {len(c)} completion tokens but {len(ids)} top-k id rows and "
                                 f"{len(lps)} top-k log-prob rows")
            if any(len(r) != k for r in ids) or any(len(r) != k for r in lps):
                raise ValueError(f"Rollouts sample {i}: every top-k row must hold k = {k} entries")

    def _check_completion_mask(self) -> None:
        if len(self.completion_mask) != len(self):
            raise ValueError(f"Rollouts.completion_mask has {len(self.completion_mask)} samples, expected {len(self)}")
        for i, (c, m) in enumerate(zip(self.completion_ids, self.completion_mask)):
            if len(m) != len(c) or any(v not in (0, 1) for v in m):
                raise ValueError(f"Rollouts sample {i}: completion_mask must hold one 0 or 1 per completion token "
                                 f"({len(c)} tokens, got {len(m)} entries)")

    def sampled_mask(self, i: int) -> list[int]:
        """Sample ``i``'s completion_mask, all ones when the batch has none (every token sampled)."""
        return self.completion_mask[i] if self.completion_mask else [1] * len(self.completion_ids[i])

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens the engine sampled (context tokens inside multi-turn completions not counted)."""
        if not self.completion_mask:
            return self.num_completion_tokens
        return sum(sum(m) for m in self.completion_mask)

    @property
    def topk(self) -> int:
        """k of the top-k log-probs (0 when none were returned)."""
        for rows in self.topk_ids:
            if rows:
                return len(rows[0])
        return 0

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    def take_groups(self, groups: Sequence[int]) -> "Rollouts":
        """The samples of the given groups (prompt indices), in that order; groups stay whole."""
        g = self.group_size
        idx = group_sample_indices(groups, g)
        bad = [gi for gi in groups if not 0 <= gi < len(self) // g]
        if bad:
            raise IndexError(f"Rollouts.take_groups: groups {bad[:5]} out of range for {len(self) // g} groups")

        def pick(values: list) -> list:
            return [values[i] for i in idx] if values else []

        return Rollouts(prompt_ids=pick(self.prompt_ids), completion_ids=pick(self.completion_ids),
                        rollout_logprobs=pick(self.rollout_logprobs), finish_reasons=pick(self.finish_reasons),
                        group_size=g, completion_texts=pick(self.completion_texts), topk_ids=pick(self.topk_ids),
                        topk_logprobs=pick(self.topk_logprobs), completion_mask=pick(self.completion_mask),
                        routes=pick(self.routes), support=pick(self.support), versions=pick(self.versions),
                        stale_kv=pick(self.stale_kv), images=pick(self.images))

    @classmethod
    def concat(cls, parts: Sequence["Rollouts"]) -> "Rollouts":
        """One batch of the samples of ``parts``, in order (same group size and top-k)."""
        if not parts:
            raise ValueError("Rollouts.concat: no parts")
        sizes, ks = {p.group_size for p in parts}, {p.topk for p in parts if len(p)}
        if len(sizes) > 1 or len(ks) > 1:
            raise ValueError(f"Rollouts.concat: parts differ in group_size {sorted(sizes)} or top-k {sorted(ks)}")

        def joined(name: str) -> list:
            return [x for p in parts for x in getattr(p, name)]

        texts = joined("completion_texts") if all(p.completion_texts or not len(p) for p in parts) else []
        # A part without a mask sampled every token: spelled out only when another part has one.
        masks = ([m for p in parts for m in (p.completion_mask or [[1] * len(c) for c in p.completion_ids])]
                 if any(p.completion_mask for p in parts) else [])
        for name in ("routes", "support", "versions", "stale_kv", "images"):
            if any(getattr(p, name) for p in parts) and not all(getattr(p, name) or not len(p) for p in parts):
                raise ValueError(f"Rollouts.concat: some parts carry {name} and others none")
        return cls(prompt_ids=joined("prompt_ids"), completion_ids=joined("completion_ids"),
                   rollout_logprobs=joined("rollout_logprobs"), finish_reasons=joined("finish_reasons"),
                   group_size=parts[0].group_size, completion_texts=texts, topk_ids=joined("topk_ids"),
                   topk_logprobs=joined("topk_logprobs"), completion_mask=masks, routes=joined("routes"),
                   support=joined("support"), versions=joined("versions"), stale_kv=joined("stale_kv"),
                   images=joined("images"))


@dataclass
class Scored:
    """An engine's log-probs of GIVEN sequences (``score``): per sequence, per token t >= 1, at temperature 1.

    logprobs[k][t - 1] = log p(x_t | x_<t); with top-k, topk_ids / topk_logprobs[k][t - 1] hold the
    k most likely tokens at that position, most likely first (else empty lists). ``routes``: one
    [len(sequence), MoE layers, top_k] tensor per sequence when the engine returns routes (its prefill's).
    """

    logprobs: list[list[float]]
    topk_ids: list[list[list[int]]]
    topk_logprobs: list[list[list[float]]]
    routes: list = field(default_factory=list)  # an MoE engine's routes of each whole sequence (``rollout.routes``)

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[list, list, list]]) -> "Scored":
        """From one ``(logprobs, topk_ids, topk_logprobs)`` per sequence, in order."""
        rows = list(rows)
        return cls([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
