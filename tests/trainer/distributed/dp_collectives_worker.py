"""Worker for tests/trainer/distributed/test_data_parallel.py (torchrun, 2 ranks): the DataParallel collectives.

- broadcast_object and raise_together (rank 1 fails alone);
- batch-level statistics pooled with ``all_sum``: whitening, REINFORCE++'s advantages and
  PPO's targets (whitened rewards and advantages, the adaptive KL controller's beta) on each
  rank's half of a batch, against one process computing them on the whole batch;
- the correction's report pooled with ``pool`` (correction/*, the per-bucket tables, the shadow table) and a
  batch-normalised plan's weights, against the whole batch.

Each rank writes its outcome as JSON to its own file (argv[1]/rank_N.json): two ranks
printing to one pipe can interleave their lines (seen in CI: "RANK 1 ...RANK 0 ..." on one line).
"""
import json
import sys
from pathlib import Path

import torch

from trainer.distributed.data_parallel import DataParallel


def _batch(seed: int, rows: int = 8, cols: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).float()
    return torch.randn(rows, cols, generator=g), mask, torch.randn(rows, generator=g)


def pooled_statistics(dp: DataParallel) -> dict:
    """Max |difference| between this rank's pooled results and its rows of the whole-batch results."""
    from trainer.algorithms import ADVANTAGES, AdvantageInputs, PPOConfig
    from trainer.algorithms.sequence import whiten
    from trainer.config import AlgorithmConfig, RunConfig
    from trainer.measurement.scoring import Scores
    from trainer.rl.critic import make_kl_controller, ppo_targets

    x, mask, rewards = _batch(0)
    half = slice(dp.rank * 4, dp.rank * 4 + 4)
    out = {"whiten": float((whiten(x[half], mask[half], all_sum=dp.all_sum) - whiten(x, mask)[half]).abs().max())}

    rpp = ADVANTAGES.get("reinforce_pp_baseline")
    whole = rpp(AdvantageInputs(rewards=rewards, mask=mask, group_size=2), None)
    mine = rpp(AdvantageInputs(rewards=rewards[half], mask=mask[half], group_size=2, all_sum=dp.all_sum), None)
    out["reinforce_pp"] = float((mine - whole[half]).abs().max())

    cfg = RunConfig()
    cfg.algorithm = AlgorithmConfig(name="ppo", options=PPOConfig(whiten_rewards=True, reward_kl_coef=0.1,
                                                                  reward_kl_target=0.5, reward_kl_horizon=10))
    lp, _, _ = _batch(1)
    ref, values, _ = _batch(2)
    scored = Scores(logprobs=lp, ref_logprobs=ref, values=values)
    ctl_whole, ctl_mine = make_kl_controller(cfg.algorithm.options), make_kl_controller(cfg.algorithm.options)
    adv_w, ret_w, m_w = ppo_targets(scored, rewards, mask, 1, cfg, ctl_whole)
    adv_m, ret_m, m_m = ppo_targets(scored.rows(half), rewards[half], mask[half], 1, cfg,
                                    ctl_mine, all_sum=dp.all_sum)
    out["ppo_advantages"] = float((adv_m - adv_w[half]).abs().max())
    out["ppo_returns"] = float((ret_m - ret_w[half]).abs().max())
    out["kl_ref_seq"] = abs(m_m["train/kl_ref_seq"] - m_w["train/kl_ref_seq"])
    out["beta"] = ctl_mine.value
    out["beta_whole"] = ctl_whole.value
    out.update(pooled_correction(dp))
    return out


def pooled_correction(dp: DataParallel) -> dict:
    """correction_report on each rank's half against one process's whole batch (batch-normalised, with the shadow)."""
    from types import SimpleNamespace

    from trainer.config import CorrectionSection
    from trainer.measurement.correction_report import correction_report
    from trainer.measurement.scoring import Scores
    from trainer.rl.update import correction_weights

    lp, mask, _ = _batch(3)
    lp = -lp.abs()
    g = torch.Generator().manual_seed(4)
    rollout = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask
    adv = torch.randn(8, 1, generator=g).expand(8, 6) * mask
    entropy = torch.rand(8, 6, generator=g) * 3
    section = CorrectionSection(rule=["token_tis", "seq_max_k3"], batch_normalize=True, shadow=True)
    half = slice(dp.rank * 4, dp.rank * 4 + 4)

    def report(rows, pool_dp):
        batch = SimpleNamespace(rollout_logprobs=rollout[rows], mask=mask[rows])
        return correction_report(section, batch, Scores(logprobs=lp[rows], entropy=entropy[rows]), adv[rows],
                                 pool_dp, shadow=True)

    (m_whole, t_whole), (m_mine, t_mine) = report(slice(None), DataParallel()), report(half, dp)
    cfg = SimpleNamespace(parity=SimpleNamespace(correction=section))
    w_whole = correction_weights(cfg, lp, SimpleNamespace(rollout_logprobs=rollout, mask=mask), adv)
    w_mine = correction_weights(cfg, lp[half], SimpleNamespace(rollout_logprobs=rollout[half], mask=mask[half]),
                                adv[half], all_sum=dp.all_sum)
    shadow_diff = max(abs(a[c] - b[c]) for a, b in zip(t_mine["correction_shadow"], t_whole["correction_shadow"])
                      for c in a if isinstance(a[c], float))
    return {"correction_keys_equal": float(m_mine.keys() == m_whole.keys() and m_whole["correction/frac_masked"] > 0),
            "correction_metrics": max(abs(m_mine[k] - m_whole[k]) / max(1.0, abs(m_whole[k])) for k in m_whole),
            "correction_shadow": shadow_diff,
            "correction_tables_equal": float({k: v for k, v in t_mine.items() if k != "correction_shadow"}
                                             == {k: v for k, v in t_whole.items() if k != "correction_shadow"}),
            "correction_weights": float((w_mine - w_whole[half]).abs().max())}


def stops(dp: DataParallel) -> dict:
    """Rank 1 alone has a failing reward and a SIGTERM: both ranks stop with its message and signal."""
    import signal

    from trainer.lifecycle.preemption import Preemption
    from trainer.lifecycle.stops import RewardFailed, stop_together

    try:
        stop_together(dp, RewardFailed("step 2: reward function 'r' returned nan at sample 0") if dp.rank else None)
        stopped = "no exception"
    except RewardFailed as e:
        stopped = f"{type(e).__name__} {e.exit_status}: {e}"
    preemption = Preemption(announce=False)
    preemption.signum = signal.SIGTERM if dp.rank else None
    return {"stop_together": stopped, "preempted": preemption.requested(dp)}


def main() -> None:
    torch.distributed.init_process_group("gloo")
    dp = DataParallel.current()
    assert dp.world == 2, dp
    tag = dp.broadcast_object("abc" if dp.rank == 0 else None)
    dp.raise_together(None)  # nobody failed: no exception anywhere
    error = ValueError("bad reward on rank 1") if dp.rank == 1 else None
    try:
        dp.raise_together(error)
        outcome = "no exception"
    except ValueError as e:
        outcome = f"own=ValueError: {e}"
    except RuntimeError as e:
        outcome = f"others=RuntimeError: {str(e).split(' (')[0]}"
    result = {"raise_together": f"RANK {dp.rank} tag={tag} {outcome}", "pooled": pooled_statistics(dp),
              **stops(dp)}
    (Path(sys.argv[1]) / f"rank_{dp.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from worker_exit import finish  # this script's folder is on sys.path

    main()
    finish()
