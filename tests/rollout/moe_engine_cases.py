"""Routes from the real vLLM engine (the V1 runner's capture, rollout/vllm_plugins/route_capture.py) and rollout
routing replay in training on them. One engine for the module: the architecture zoo's random Qwen3-MoE (top-2 of
8 experts, weights at std 0.2: routers with near-ties) in bf16.

Not collected by the suite itself: test_vllm_routes.py runs this file in a pytest process of its own, where no
dense engine was started first (vLLM's parallel groups are process-wide; VLLMEngine refuses an MoE engine
beside a dense one). Run it directly with ``pytest tests/rollout/moe_engine_cases.py``."""
import json
from pathlib import Path

import pytest
import torch
import transformers

from rollout.hf_engine import HFEngine
from rollout.hf_routes import RouterTap
from rollout.routes import NO_ROUTE
from rollout.types import SamplingSpec
from trainer.builtin.zoo import ensure_arch_model
from trainer.lifecycle.preflight import load_recipe
from trainer.rl.loop import train

REPO = Path(__file__).resolve().parents[2]
ENVS = REPO / "tests" / "trainer" / "rl" / "episode_envs.py"
pytestmark = pytest.mark.slow
PROMPTS = [[1, 3, 40, 77, 301, 4], [1, 3, 9, 500, 4]]


@pytest.fixture(scope="module")
def moe_dir():
    return str(ensure_arch_model("qwen3_moe", dtype="bfloat16"))


@pytest.fixture(scope="module")
def moe_engine(moe_dir):
    from rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(moe_dir, dtype="bfloat16", max_model_len=256, seed=0, kv_cache_memory_bytes=256 * 1024**2,
                        return_routes=True)
    yield engine
    engine.close()


def own_routes(model, seq):
    with RouterTap(model) as tap, torch.no_grad():
        model(torch.tensor([seq]))
    return torch.stack([c[0] for c in tap.calls], 1)


def test_the_engine_routes_every_token_it_computed_as_the_model_would(moe_engine, moe_dir):
    assert moe_engine.route_shape == {"layers": 2, "top_k": 2, "num_experts": 8}
    out = moe_engine.generate(PROMPTS, SamplingSpec(n=2, temperature=1.0, max_new_tokens=16, seed=3))
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16)
    agree = total = 0
    for p, c, r in zip(out.prompt_ids, out.completion_ids, out.routes):
        n = len(p) + len(c)
        assert r.shape == (n, 2, 2) and r.dtype == torch.int16
        assert (r[-1] == NO_ROUTE).all()  # the last sampled token is never fed back
        assert ((r[:-1] >= 0) & (r[:-1] < 8)).all()  # every other token routed: prompt (no prefix cache) and decode
        own = own_routes(model, p + c)[:n - 1].long().sort(-1).values
        same = (own == r[:n - 1].long().sort(-1).values).all(-1)
        agree, total = agree + int(same.sum()), total + same.numel()
    print(f"vLLM vs transformers routes, bf16: {agree}/{total} token-layer selections agree")
    assert agree >= 0.95 * total  # bf16 near-ties flip a few (the R3 paper's point), never most

    seqs = [p + c for p, c in zip(out.prompt_ids, out.completion_ids)]
    scored = moe_engine.score(seqs)  # a prefill routes every position of the sequence
    assert [tuple(r.shape) for r in scored.routes] == [(len(s), 2, 2) for s in seqs]
    assert all((r >= 0).all() for r in scored.routes)


def test_the_hf_engine_returns_the_routes_its_forward_used(moe_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    out = HFEngine(model, return_routes=True).generate(PROMPTS, SamplingSpec(n=2, temperature=1.0,
                                                                              max_new_tokens=8, seed=1))
    for p, c, r in zip(out.prompt_ids, out.completion_ids, out.routes):
        n = len(p) + len(c)
        assert r.shape == (n, 2, 2)
        own = own_routes(model, p + c)[:n - 1]
        assert torch.equal(own.sort(-1).values, r[:n - 1].sort(-1).values)  # float32, one model: the same choice


def recipe(tmp_path, name, *sets):
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "checkpoint.every=0",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "train.micro_batch_size=8", "eval.every=0",
        "train.steps=2", *sets])


def rows_of(cfg):
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_replay_removes_most_of_the_mismatch_routing_flips_cause(tmp_path, moe_engine, moe_dir):
    cfg = recipe(tmp_path, "replay", f"model.path={moe_dir}", "parity.routing_replay=on", "parity.unreplayed_every=1")
    train(cfg, engine=moe_engine)
    steps = [r for r in rows_of(cfg) if r.get("step", 0) >= 1 and "parity/mae" in r]
    assert len(steps) == 2
    for r in steps:
        print({k: round(v, 5) for k, v in r.items() if "routing" in k or k.endswith(("/kl_k3", "/mae"))})
        assert 0.9 < r["parity/routing_agree"] < 1.0 and r["parity/routing_unrouted"] == 0
        assert 0 < r["parity/routing_tokens_any_diff"] < 0.2
        # the same batch scored with the trainer's routers choosing: what replay removed
        assert r["parity/kl_k3"] < 0.3 * r["parity/unreplayed/kl_k3"]
        assert r["parity/max_abs"] < r["parity/unreplayed/max_abs"]
    tables = [json.loads(line) for line in (cfg.run_dir / "parity_breakdown.jsonl").read_text().splitlines()]
    assert [sorted(row) for row in tables[0]["routing_by_layer"]] == [["agree", "agree_unreplayed", "moe_layer"]] * 2


def test_measure_logs_the_agreement_without_replaying_and_episodes_are_routed_everywhere(tmp_path, moe_engine,
                                                                                          moe_dir):
    cfg = recipe(tmp_path, "measure", f"model.path={moe_dir}", "parity.routing_replay=measure")
    train(cfg, engine=moe_engine)
    steps = [r for r in rows_of(cfg) if r.get("step", 0) >= 1 and "parity/mae" in r]
    assert all(0.9 < r["parity/routing_agree"] < 1.0 for r in steps)
    assert not any(k.startswith("parity/unreplayed/") for r in steps for k in r)

    # two-turn episodes: each position's route comes from the turn that computed it, none is missing
    cfg = recipe(tmp_path, "episodes", f"model.path={moe_dir}", "parity.routing_replay=on",
                 f"env.class={ENVS}:FollowUp", "env.max_turns=2", "env.max_tokens=128")
    train(cfg, engine=moe_engine)
    steps = [r for r in rows_of(cfg) if r.get("step", 0) >= 1 and "parity/mae" in r]
    assert all(r["parity/routing_unrouted"] == 0 and r["parity/routing_agree"] > 0.9 for r in steps)
    assert all("parity/turn_2/mae" in r for r in steps)


def test_compare_reports_the_routing_and_the_parity_without_replay(moe_engine, moe_dir, tmp_path, capsys):
    from trainer.cli import _compare_digest
    from trainer.diagnostics.compare import run_compare

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Ann has 3 apples and buys 4 more.\nHow many legs do 2 cats have?\n")
    summary = run_compare(moe_dir, prompts, tmp_path / "report", engine=moe_engine, n=8, max_new_tokens=24)
    r = summary["routing"]
    assert 0.9 < r["parity/routing_agree"] < 1.0 and r["parity/routing_unrouted"] == 0
    assert summary["metrics"]["parity/kl_k3"] < r["unreplayed"]["parity/kl_k3"]  # the same tokens, replay removed
    assert "routing agree" in _compare_digest(summary, str(tmp_path / "report"))



def test_an_engine_of_another_model_is_refused_before_any_rollout(tmp_path, moe_engine):
    from trainer.config import RecipeError

    other = str(ensure_arch_model("qwen2_moe", dtype="bfloat16"))  # 4 experts where the engine's model has 8
    with pytest.raises(RecipeError, match=r"the engine's routes are \{'layers': 2, 'top_k': 2, 'num_experts': 8\}, "
                                          r"the trainer's model has .*'num_experts': 4\}"):
        train(recipe(tmp_path, "other", f"model.path={other}", "parity.routing_replay=on"), engine=moe_engine)
    assert not (tmp_path / "other" / "metrics.jsonl").exists()
