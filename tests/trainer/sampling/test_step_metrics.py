"""Per-step rollout/reward spread metrics (trainer.sampling.sampler.spread_metrics), hand-computed."""
import math

from rollout.types import Rollouts
from trainer.distributed.data_parallel import DataParallel
from trainer.sampling.drawn import Drawn
from trainer.sampling.sampler import spread_metrics


def test_reward_std_flat_groups_and_length_range():
    lengths = [3, 5, 1, 4, 2, 2, 7, 2]
    r = Rollouts(prompt_ids=[[1]] * 8, completion_ids=[[9] * n for n in lengths], rollout_logprobs=[[0.0] * n for n in lengths],
                 finish_reasons=["stop"] * 8, group_size=4)
    drawn = Drawn(rows=[{"prompt": "a"}, {"prompt": "b"}], rollouts=r, rewards=[1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                  per_fn={})
    m = spread_metrics(drawn, DataParallel())
    # mean 3/8 = .375; E[r^2] = .375; var = .375 - .140625 = .234375
    assert math.isclose(m["reward/std"], math.sqrt(0.234375), rel_tol=1e-12)
    assert m["reward/frac_zero_std_groups"] == 0.5  # the second group is all 0: no signal
    assert (m["rollout/min_length"], m["rollout/max_length"]) == (1.0, 7.0)
