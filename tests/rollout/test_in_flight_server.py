"""In-flight weight updates against a real `parityrl serve` server (slow tier): a push while requests run reaches
them in the middle of their generation; each token carries the version that sampled it; ``recompute`` re-prefills
the running requests under the new weights, ``keep`` continues them on the old weights' KV, which the trainer then
measures apart. One server for the module, started for a ``keep`` recipe (prefix caching off); a ``recompute``
client works on it too."""
import signal
import threading
import time

import pytest
import torch
from test_server_engine import PARITY_MAE_BOUND, Server, abs_errors, cfg_for

from rollout.server_engine import ServerEngine
from rollout.types import SamplingSpec
from rollout.weight_export import full_weights

pytestmark = pytest.mark.slow

IN_FLIGHT = ("rollout.mode=server", "rollout.max_staleness=1", "rollout.in_flight=keep")
# engine vs an unpadded HF forward of the same weights (test_server_engine.py's MAE_BOUND)
NUMERICS = 0.02
# the mean over the few tokens a push leaves in a sample (a handful): bfloat16's heavy-tailed per-token error
NEAR_FEW_TOKENS = 0.1
# tokens the new weights sample in the interrupted samples, at least: with 2 (a push at a sample's last tokens, on
# CI) the continuation was an end-of-answer the old KV barely moves (0.009 from a fresh forward), with 6 it was 5.3
MIN_AFTER_PUSH = 8
# the "old" weights: every layer's keys and values moved by 4 std, so that the KV they leave behind is far from the
# reference's (a perturbation of layers 1-2's attention and MLP moved the log-probs by 0.63, yet a token sampled over
# its KV by the reference differed from the reference's own forward by only 6.5e-3: the residual stream carries most
# of the context, and a KV cache two layers deep in it is a small part)
NAMES = [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(4) for m in "kv"]


@pytest.fixture(scope="module")
def keep_server(tmp_path_factory):
    # one sequence at a time: a batch's requests run one after another, so a push lands while one runs, some have
    # finished and the rest wait, and a training step is shorter than the generation launched beside it
    s = Server(tmp_path_factory.mktemp("keep_server"), *IN_FLIGHT, "rollout.max_num_seqs=1")
    yield s
    s.kill(signal.SIGTERM)


def _mixed_generation(engine, old, new, prompts):
    """Generate with ``old`` weights and push ``new`` in flight once tokens have come out: the rollouts and the
    versions of the two weights. Retried with another push time until the samples the push interrupted hold
    MIN_AFTER_PUSH tokens the new weights sampled (a loaded machine's timing: a push late in the one sample it
    interrupts leaves a handful, too few to tell the old-KV continuation from a fresh forward)."""
    spec = SamplingSpec(n=6, temperature=1.0, max_new_tokens=60, seed=3)
    for wait_s in (0.5, 1.0, 1.5, 2.5, 3.5):
        engine.load_weights(full_weights(old, dtype=torch.bfloat16))
        v_old, box = engine.weight_version, {}
        worker = threading.Thread(target=lambda out=box: out.update(r=engine.generate(prompts, spec)))
        worker.start()
        time.sleep(wait_s)
        with engine.in_flight_update():
            engine.load_weights(full_weights(new, dtype=torch.bfloat16))
        worker.join(timeout=300)
        r, v_new = box["r"], engine.weight_version
        after = sum(len(v) - v.index(v_new) for v in r.versions if len(set(v)) == 2)
        if after >= MIN_AFTER_PUSH:
            return r, v_old, v_new
    pytest.fail(f"no push time left {MIN_AFTER_PUSH} tokens after it in the samples it interrupted (five tries)")


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_push_in_flight_reaches_running_requests_with_versions_per_token(keep_server, tiny_model_dir, hf_reference,
                                                                          perturbed_copy, hf_logprobs, prompts, mode):
    old = perturbed_copy(hf_reference, NAMES, scale=4.0, seed=1)
    engine = ServerEngine(keep_server.url, model_dir=tiny_model_dir, timeout_s=300, max_model_len=88, in_flight=mode)
    try:
        r, v_old, v_new = _mixed_generation(engine, old, hf_reference, prompts)
    finally:
        engine.load_weights(full_weights(hf_reference, dtype=torch.bfloat16))
        engine.close()
    assert all(set(v) <= {v_old, v_new} and v == sorted(v) for v in r.versions)
    kinds = {"old": 0, "mixed": 0, "new": 0}
    for v in r.versions:
        kinds["mixed" if len(set(v)) == 2 else "old" if v[0] == v_old else "new"] += 1
    # each token against the HF forward of the weights that sampled it, over its whole context (fresh KV)
    ref_old = hf_logprobs(old, r.prompt_ids, r.completion_ids, 1.0)
    ref_new = hf_logprobs(hf_reference, r.prompt_ids, r.completion_ids, 1.0)
    own = [[o if v == v_old else n for o, n, v in zip(ro, rn, vs)] for ro, rn, vs in zip(ref_old, ref_new, r.versions)]
    d = abs_errors(r.rollout_logprobs, own)
    flat_stale = torch.tensor([s for row in r.stale_kv for s in row], dtype=torch.bool)
    fresh, stale = d[~flat_stale], d[flat_stale]
    print(f"{mode}: samples {kinds}; fresh-KV tokens {fresh.numel()} MAE {fresh.mean():.4g}; stale-KV tokens "
          f"{stale.numel()} MAE {stale.mean() if stale.numel() else float('nan'):.4g}")
    assert kinds["mixed"] >= 1
    # every token that read fresh KV matches its own version's forward: recompute really re-prefilled
    assert fresh.mean() < NUMERICS
    if mode == "recompute":
        assert not flat_stale.any()
    else:  # keep: exactly the tokens after the push in a sample that started before it read the old weights' KV
        assert r.stale_kv == [[int(x != v[0]) for x in v] for v in r.versions] and stale.numel() > 0
    # The tokens the new weights sampled in a sample the push interrupted, against HF's new weights continuing from
    # the old weights' KV cache and against a fresh forward of the new weights: keep is the first, recompute the
    # second (a pause that preempts the requests would make keep the second too)
    engine_after, over_old_kv, fresh_new = [], [], []
    for p_ids, c_ids, vs, lps in zip(r.prompt_ids, r.completion_ids, r.versions, r.rollout_logprobs):
        if len(set(vs)) == 2:
            k = vs.index(v_new)  # the first token the new weights sampled; its input is token k - 1
            engine_after += lps[k:]
            over_old_kv += continued_over(old, hf_reference, list(p_ids) + list(c_ids[:k - 1]), c_ids[k - 1:])
            fresh_new += hf_logprobs(hf_reference, [p_ids], [c_ids], 1.0)[0][k:]
    engine_after = torch.tensor(engine_after)
    vs_old_kv = (engine_after - torch.tensor(over_old_kv)).abs().mean()
    vs_fresh = (engine_after - torch.tensor(fresh_new)).abs().mean()
    print(f"{mode}, {engine_after.numel()} tokens after the push: engine vs HF over the old KV {vs_old_kv:.4g}, "
          f"vs a fresh forward {vs_fresh:.4g}")
    near, far = (vs_old_kv, vs_fresh) if mode == "keep" else (vs_fresh, vs_old_kv)
    # which of the two the engine tracks, with a margin: the tokens after the push are few (at least MIN_AFTER_PUSH;
    # 6 of them averaged a bfloat16 error of 0.023 over the 4-std KV where 900 fresh-KV tokens averaged 0.009), so
    # `near` gets NEAR_FEW_TOKENS and must sit 10x below `far`; what keep costs stays far beyond numerics, hence
    # measured apart
    assert near < NEAR_FEW_TOKENS and far > 10 * near and far > 5 * NUMERICS


def continued_over(old, new, context, tokens):
    """Log-probs of ``tokens[1:]`` when ``new`` continues from ``old``'s KV cache of ``context`` (fed ``tokens``):
    what an engine computes for a request that ``keep`` continued after a push (an empty context: ``tokens[0]``
    is the first)."""
    with torch.no_grad():
        cache = old(torch.tensor([context]), use_cache=True).past_key_values if context else None
        logits = new(torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1).tolist()


def test_training_with_in_flight_keep_measures_numerics_lag_and_stale_kv_apart(keep_server, tmp_path, monkeypatch):
    """Three GRPO steps, one off, with keep: parity/* (fresh-KV tokens, each under its own version) stays numerics,
    staleness/* and the lag shares describe the lag, parity/stale_kv/* the tokens keep continued on old KV.

    The push must land inside the launched generation whatever the machine's speed: a training step can outlast the
    generation launched beside it (the first step's, on a loaded machine), and a sync after it would find nothing
    running. So a launched generation starts only once the step's sync is reached, and the sync pushes a second
    later (one request at a time at ~70 tokens/s: a batch takes several seconds)."""
    from trainer.rl import loop
    from trainer.rl.loop import train

    at_sync, started = threading.Event(), threading.Event()
    real_generate, real_sync = ServerEngine.generate, loop.sync_phase

    def generate(self, prompt_ids, spec):
        if threading.current_thread().name.startswith("parityrl-rollout-"):  # launched beside the step
            assert at_sync.wait(timeout=300)
            at_sync.clear()
            started.set()
        return real_generate(self, prompt_ids, spec)

    def sync_phase(run, step, m):
        if run.prefetch.pending:  # a batch was launched this step: let it start, push once it is under way
            at_sync.set()
            assert started.wait(timeout=300)
            started.clear()
            time.sleep(1.0)
        real_sync(run, step, m)

    monkeypatch.setattr(ServerEngine, "generate", generate)
    monkeypatch.setattr(loop, "sync_phase", sync_phase)
    res = train(cfg_for(tmp_path, "keep", keep_server.url, *IN_FLIGHT, "train.steps=3", "checkpoint.every=0",
                        "train.learning_rate=1e-2")).history
    for h in res:
        shares = {k: round(v, 3) for k, v in h.items() if k.endswith("/share")}
        print(h["step"], f"parity/mae {h['parity/mae']:.2e}", shares, f"lag_mean {h.get('staleness/lag_mean')}",
              f"stale_kv/mae {h.get('parity/stale_kv/mae', float('nan')):.3g}")
    assert all(h["parity/mae"] < PARITY_MAE_BOUND for h in res)  # each token under its own version: numerics
    for h in res[1:]:
        # the batch launched at the step before held tokens of both versions: lags 1 and 0
        assert h["staleness/lag_1/share"] + h["staleness/lag_0/share"] == pytest.approx(1.0)
        assert 0.0 < h["staleness/lag_mean"] < 1.0 and h["staleness/lag_max"] == 1.0
        assert h["staleness/lag_0/mae"] == 0.0 < h["staleness/lag_1/mae"]  # lag 0: sampled by the current weights
        assert h["perf/prefetch_wait_s"] == 0.0  # the sync did not wait for the generation
        if h["parity/stale_kv/share"]:  # a push that interrupted a request, not one between two
            # measured apart; its size is what one step's update moves the KV by (at lr 1e-2 here: 3.5e-5 to 1.5e-2
            # in one run), the engine-level test above shows it beyond the numerics for weights far apart
            assert h["parity/stale_kv/num_tokens"] == pytest.approx(h["parity/stale_kv/share"] * (
                h["parity/num_tokens"] + h["parity/stale_kv/num_tokens"]))
    # keep continued some request on the old KV (one runs at a time: a push lands inside one unless it ends then)
    assert sum(h["parity/stale_kv/share"] for h in res[1:]) > 0
