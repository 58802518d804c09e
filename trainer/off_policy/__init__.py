"""How an update treats a batch that an older policy generated (``rollout.max_staleness`` >= 1): one record per
objective (``record.py``), chosen by ``algorithm.off_policy``. Each is registered on import."""
from trainer.off_policy import behaviour_clip, decoupled, m2po  # noqa: F401  (registers the records)
from trainer.off_policy.record import OFF_POLICY, OffPolicyObjective

__all__ = ["OFF_POLICY", "OffPolicyObjective"]
