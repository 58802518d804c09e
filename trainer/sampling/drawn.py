"""What a sampling round hands the rest of the step: ``Drawn``, one round's samples on this rank.

Every sampling round makes one (completions: ``trainer.sampling.sampler``; episodes:
``trainer.sampling.episode_sampler``); dynamic sampling keeps some of its groups and concatenates rounds
(``trainer.sampling.dynamic_sampling``); the one-step-off prefetch carries one across a step
(``trainer.sampling.async_prefetch``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout.types import Rollouts, group_sample_indices


@dataclass
class Drawn:
    """One round's samples on this rank: prompt rows (one per group), rollouts, rewards and timings."""

    rows: list[dict]
    rollouts: Rollouts
    rewards: list[float]  # [S] weighted total
    per_fn: dict[str, list[float]]  # [S] per reward source
    generate_s: float = 0.0
    reward_s: float = 0.0
    # multi-turn episodes (trainer/sampling/episode_sampler.py): name -> [S] per-episode record; empty for single-turn
    episodes: dict[str, list[float]] = field(default_factory=dict)
    # a vision-language batch: per row (prompt) the trainer's pixels of its images (trainer.vision.pixels), found
    # identical to what the engine consumed; empty for text
    pixels: list = field(default_factory=list)

    @property
    def num_groups(self) -> int:
        return len(self.rows)

    def take_groups(self, groups: list[int]) -> "Drawn":
        idx = group_sample_indices(groups, self.rollouts.group_size)
        return Drawn(rows=[self.rows[gi] for gi in groups], rollouts=self.rollouts.take_groups(groups),
                     rewards=[self.rewards[i] for i in idx],
                     per_fn={k: [v[i] for i in idx] for k, v in self.per_fn.items()},
                     episodes={k: [v[i] for i in idx] for k, v in self.episodes.items()},
                     pixels=[self.pixels[gi] for gi in groups] if self.pixels else [])

    @staticmethod
    def concat(parts: list["Drawn"]) -> "Drawn":
        if len(parts) == 1:  # the usual step (one round): nothing to copy
            return parts[0]
        return Drawn(rows=[r for p in parts for r in p.rows], rollouts=Rollouts.concat([p.rollouts for p in parts]),
                     rewards=[x for p in parts for x in p.rewards],
                     per_fn={k: [x for p in parts for x in p.per_fn[k]] for k in parts[0].per_fn},
                     generate_s=sum(p.generate_s for p in parts), reward_s=sum(p.reward_s for p in parts),
                     episodes={k: [x for p in parts for x in p.episodes[k]] for k in parts[0].episodes},
                     pixels=[x for p in parts for x in p.pixels])
