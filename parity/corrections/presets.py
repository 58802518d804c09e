"""Named combinations a researcher can ask for by name, from verl's ``RolloutCorrectionConfig`` presets
(verl/trainer/config/algorithm.py; docs/algo/rollout_corr.md "Preset Configuration Guide"), in this package's terms.

verl's ``decoupled_*`` presets keep the trainer's pi_old (three policies); ``bypass_ppo_clip*`` take pi_old = the
engine's log-probs, so PPO's clipped ratio pi_theta / pi_rollout is the importance weight and only rejection rules
join it. verl's ``bypass_pg_*`` presets (REINFORCE without a clip) need a loss this project does not have: left out.
Each preset is (rules, options per rule, bypass); the recipe's own options for those rules override the preset's.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from parity.corrections.sequence_is import SeqTISOptions
from parity.corrections.token_is import TokenMISOptions, TokenTISOptions
from parity.corrections.trust_region import SeqMeanK1Options, SeqMeanK3Options, SeqSumK1Options


class Preset(NamedTuple):
    rules: tuple[str, ...]
    options: dict[str, Any]
    bypass: bool = False


PRESETS: dict[str, Preset] = {
    "decoupled_token_is": Preset(("token_tis",), {"token_tis": TokenTISOptions(cap=2.0)}),
    "decoupled_token_icepop": Preset(("token_mis",), {"token_mis": TokenMISOptions(low=0.5, high=5.0)}),
    "decoupled_seq_is": Preset(("seq_tis",), {"seq_tis": SeqTISOptions(cap=2.0)}),
    "decoupled_seq_is_rs": Preset(("seq_tis", "seq_sum_k1"), {"seq_tis": SeqTISOptions(cap=2.0),
                                                             "seq_sum_k1": SeqSumK1Options(low=0.5, high=2.0)}),
    "decoupled_geo_rs": Preset(("seq_mean_k1",), {"seq_mean_k1": SeqMeanK1Options(low=0.999, high=1.001)}),
    "decoupled_geo_rs_token_tis": Preset(("token_tis", "seq_mean_k1"), {
        "token_tis": TokenTISOptions(cap=2.0), "seq_mean_k1": SeqMeanK1Options(low=0.999, high=1.001)}),
    "decoupled_k3_rs": Preset(("seq_mean_k3",), {"seq_mean_k3": SeqMeanK3Options(max_kl=0.01)}),
    "decoupled_k3_rs_token_tis": Preset(("token_tis", "seq_mean_k3"), {
        "token_tis": TokenTISOptions(cap=2.0), "seq_mean_k3": SeqMeanK3Options(max_kl=0.01)}),
    "bypass_ppo_clip": Preset((), {}, bypass=True),
    "bypass_ppo_clip_geo_rs": Preset(("seq_mean_k1",), {"seq_mean_k1": SeqMeanK1Options(low=0.999, high=1.001)},
                                     bypass=True),
    "bypass_ppo_clip_k3_rs": Preset(("seq_mean_k3",), {"seq_mean_k3": SeqMeanK3Options(max_kl=0.01)}, bypass=True),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown correction preset {name!r}; valid names: {', '.join(PRESETS)}") from None
