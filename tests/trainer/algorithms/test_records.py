"""One record per algorithm: a minimal recipe gets the paper's options, and only its own keys.

Expected values are written out by hand from the sources cited per row, not read from the
options classes, so a default changed in code without its source fails here.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainer.algorithms import ALGORITHMS, Algorithm, OptionError
from trainer.config import RecipeError
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]

# name -> the options a recipe with only `algorithm.name` must get.
PAPER_DEFAULTS = {
    # DeepSeekMath (arXiv 2402.03300) Eq. 3 with PPO's clip 0.2 (arXiv 1707.06347 Sec. 6.1); no KL as in
    # DAPO (arXiv 2503.14476 Sec. 2.3) and TRL's GRPOConfig (beta=0.0); token-mean aggregation (DAPO Sec. 3.3);
    # std + 1e-4 as TRL.
    "grpo": dict(scale_rewards=True, eps=1e-4, clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, loss_agg="token_mean"),
    # Dr. GRPO (arXiv 2503.20783 Sec. 3.1): GRPO's clip, no KL; scale_rewards / loss_agg are fixed, not options.
    "dr_grpo": dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0),
    # GSPO (arXiv 2507.18071 Sec. 5.1): sequence-ratio clip ranges 3e-4 / 4e-4.
    "gspo": dict(scale_rewards=True, eps=1e-4, clip_eps_low=3e-4, clip_eps_high=4e-4, kl_coef=0.0),
    # RLOO (arXiv 2402.14740) with TRL's RLOOConfig clip epsilon 0.2.
    "rloo": dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0),
    # REINFORCE++-baseline (arXiv 2501.03262) with PPO's loss as OpenRLHF/verl pair it.
    "reinforce_pp_baseline": dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, loss_agg="token_mean"),
    # PMD (arXiv 2602.05933): tau 0.01 (OpenKimi's default; the authors use 0.01-0.1), no KL term.
    "pmd_mean": dict(tau=0.01, kl_coef=0.0),
    "pmd_part": dict(tau=0.01, kl_coef=0.0),
    # PPO as in TRL's PPOConfig / StackLLaMA: gamma 1, lam 0.95, cliprange 0.2, cliprange_value 0.2,
    # vf_coef 0.1, init_kl_coef 0.05, target None (fixed), horizon 10000, kl estimator k1.
    "ppo": dict(gamma=1.0, lam=0.95, whiten_advantages=True, whiten_rewards=False, clip_eps_low=0.2,
                clip_eps_high=0.2, loss_agg="token_mean", kl_coef=0.0, vf_coef=0.1, value_clip=0.2, ent_coef=0.0,
                reward_kl_coef=0.05, reward_kl_target=None, reward_kl_horizon=10000, reward_kl_estimator="k1"),
    # On-policy distillation (Thinking Machines 2025; Tinker cookbook): no baseline, discount 0, GRPO's clipped loss
    # with PPO's clip 0.2, no reference KL (the teacher is the anchor), token mean (GKD's per-token objective).
    "opd": dict(gamma=0.0, group_baseline=False, clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, loss_agg="token_mean"),
}


def _recipe(tmp_path, algorithm: str) -> str:
    p = tmp_path / "r.yaml"
    p.write_text(f"algorithm:\n{algorithm}\n")
    return str(p)


def test_every_registered_algorithm_has_its_defaults_pinned():
    assert sorted(PAPER_DEFAULTS) == ALGORITHMS.names()


@pytest.mark.parametrize("name", sorted(PAPER_DEFAULTS))
def test_minimal_recipe_gets_the_papers_options(tmp_path, name):
    teacher = "\nteacher:\n  path: builtin:tiny-teacher" if ALGORITHMS.get(name).teacher else ""
    cfg = load_recipe(_recipe(tmp_path, f"  name: {name}{teacher}"), check_paths=False)
    assert dataclasses.asdict(cfg.algorithm.options) == PAPER_DEFAULTS[name]
    assert type(cfg.algorithm.options) is ALGORITHMS.get(name).options


def test_gspo_set_on_a_grpo_recipe_gets_gspo_clip(tmp_path):
    # the reported bug: `--set algorithm.name=gspo` on a GRPO recipe trained with PPO's 0.2
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["algorithm.name=gspo"], check_paths=False)
    assert (cfg.algorithm.options.clip_eps_low, cfg.algorithm.options.clip_eps_high) == (3e-4, 4e-4)
    # a GRPO option the recipe sets is refused for gspo, not carried over silently
    with pytest.raises(RecipeError, match="algorithm.loss_agg = 'token_mean': not an option of gspo"):
        load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["algorithm.name=gspo", "algorithm.loss_agg=token_mean"],
                    check_paths=False)


REFUSED = [  # (the algorithm section, what the one-line error must say)
    # a key of another algorithm, naming the algorithms that have it
    ("  name: grpo\n  tau: 0.1", r"algorithm.tau = 0.1: not an option of grpo; it belongs to pmd_mean, pmd_part"),
    ("  name: dr_grpo\n  loss_agg: token_mean", r"algorithm.loss_agg = 'token_mean': not an option of dr_grpo"),
    ("  name: pmd_mean\n  taux: 0.1", r"unknown key 'algorithm.taux' \(did you mean 'algorithm.tau'\?\); valid keys here: name, group_size"),
    # an option out of range: key, value, expectation, algorithm
    ("  name: gspo\n  clip_eps_low: 1.5", r"r.yaml: algorithm.clip_eps_low = 1.5: expected in \[0, 1\) \(gspo\)"),
    ("  name: pmd_part\n  kl_coef: 0.1", r"algorithm.kl_coef = 0.1: expected 0 \(PMD has no KL"),
    ("  name: grpoo", r"algorithm.name = 'grpoo': expected one of dr_grpo, grpo, gspo"),
    # a capability of the record
    ("  name: rloo\n  group_size: 1", r"algorithm.group_size = 1: expected an integer >= 2 for rloo"),
    ("  name: ppo\n  dynamic_sampling: true", r"algorithm.dynamic_sampling = True: expected false for ppo"),
]


@pytest.mark.parametrize("section,message", REFUSED)
def test_refused_with_key_value_and_algorithm(tmp_path, section, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(_recipe(tmp_path, section), check_paths=False)


def test_capabilities_come_from_the_record(tmp_path):
    cfg = load_recipe(_recipe(tmp_path, "  name: ppo\n  group_size: 1"), check_paths=False)
    assert cfg.algorithm.record.critic and cfg.algorithm.group_size == 1
    assert not load_recipe(_recipe(tmp_path, "  name: grpo"), check_paths=False).algorithm.record.critic


def test_resolved_config_is_flat_like_a_recipe(tmp_path):
    from trainer.config import to_dict

    d = to_dict(load_recipe(_recipe(tmp_path, "  name: gspo"), check_paths=False))["algorithm"]
    assert d["name"] == "gspo" and d["clip_eps_high"] == 4e-4 and "options" not in d


def test_options_validate_standalone():
    from trainer.algorithms import GSPOConfig

    with pytest.raises(OptionError) as e:
        GSPOConfig(eps=0.0)
    assert (e.value.key, e.value.value, e.value.expected) == ("eps", 0.0, "> 0")


def test_a_record_must_be_well_formed():
    with pytest.raises(TypeError, match="options must be a dataclass type"):
        Algorithm(name="x", options=dict, advantage=len, loss=len, paper="-")
    with pytest.raises(ValueError, match="must register a record.Algorithm"):
        ALGORITHMS.register("y")(len)


def test_entropy_is_differentiated_only_when_the_loss_uses_it():
    """PPO's entropy bonus needs the entropy's gradient; everywhere else it is only logged (cheap backward)."""
    ppo = ALGORITHMS.get("ppo")
    assert not ppo.entropy_in_loss(ppo.options())  # ent_coef 0 by default (TRL has none)
    assert ppo.entropy_in_loss(dataclasses.replace(ppo.options(), ent_coef=0.01))
    assert not any(ALGORITHMS.get(n).entropy_in_loss(ALGORITHMS.get(n).options())
                   for n in ALGORITHMS.names() if n != "ppo")
