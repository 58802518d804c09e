"""The routing check (trainer/doctor/checks/routing.py): agreement of the experts per MoE layer, its verdicts, the
cause it gives the layers check, completeness of the engine's routes; and, in a process of its own, the doctor on the
zoo's Qwen3-MoE with replay off and on, a planted router fault, and the sync legs (moe_doctor_cases.py)."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from rollout.routes import NO_ROUTE
from trainer.doctor.checks import CHECKS
from trainer.doctor.checks.routing import (
    OWN_LEVEL,
    EngineRoutes,
    TrainerRoutes,
    completeness,
    layer_finding,
    run,
)
from trainer.doctor.records import FAIL, PASS, SKIP, WARN, CheckCannotRun

REPO = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "moe_doctor_cases.py"


def _routes(engine, used, own=None, replayed=False):
    e = EngineRoutes(chosen=engine, returned=[None] * len(engine), layers=(1, 3))
    return TrainerRoutes(e, replayed, list(used), list(own if own is not None else used))


def test_agreement_per_layer_compares_sets_and_names_the_first_layer_that_differs():
    # 2 sequences (3 + 1 tokens), MoE layers at decoder layers 1 and 3, top-2
    engine = [torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]]), torch.tensor([[[1, 2], [3, 4]]])]
    used = [torch.tensor([[[1, 0], [2, 3]], [[4, 5], [6, 5]], [[0, 2], [1, 3]]]),  # [1, 0] is the same set as [0, 1]
            torch.tensor([[[1, 2], [3, 4]]])]
    own = [torch.tensor([[[1, 0], [2, 3]], [[4, 6], [6, 5]], [[0, 2], [1, 3]]]), torch.tensor([[[1, 2], [3, 0]]])]
    r = _routes(engine, used, own)
    agree_used, agree_own, tokens = r.agreement()
    assert tokens == 4
    assert agree_used.tolist() == [1.0, 0.75] and agree_own.tolist() == [0.75, 0.5]
    assert r.cause(1 + 2 / 3) is None  # "layer 1, mlp": its experts agree
    assert r.cause(2 + 1 / 3) is None  # "layer 2, attention": no MoE layer up to it differs
    cause = r.cause(3 + 2 / 3)  # "layer 3, mlp"
    assert "the experts chosen differ" in cause and "at layer 3" in cause and "25.0% of the tokens" in cause
    assert "with parity.routing_replay on" in _routes(engine, used, own, replayed=True).cause(5.0)
    with pytest.raises(RuntimeError, match="ran on none of the sequences"):
        _routes(engine, [None, None]).agreement()


def test_a_layers_verdict_router_first_then_the_experts_used():
    d = {}
    bad = layer_finding(2, used=1.0, own=OWN_LEVEL - 0.01, replayed=True, details=d)
    assert bad.verdict == FAIL and bad.item == "layer 2: router's own top-k agree" and bad.figure == OWN_LEVEL - 0.01
    assert "layer 2's router" in bad.cause and "mlp.gate" in bad.cause
    assert layer_finding(2, used=1.0, own=0.97, replayed=True, details=d).verdict == PASS
    assert layer_finding(2, used=1.0, own=1.0, replayed=False, details=d).verdict == PASS
    near_ties = layer_finding(2, used=0.97, own=0.97, replayed=False, details=d)
    assert near_ties.verdict == WARN and near_ties.item == "layer 2: experts agree"
    assert "the experts chosen differ" in near_ties.cause and "not the MLP's weights" in near_ties.cause
    assert "parity.routing_replay: on" in near_ties.cause
    broken_replay = layer_finding(2, used=0.97, own=0.97, replayed=True, details=d)
    assert broken_replay.verdict == FAIL and "the routes replayed are not the engine's" in broken_replay.cause


def _doc(routing, routes):
    return SimpleNamespace(routing=routing, batch=lambda: SimpleNamespace(routes=routes))


def test_completeness_counts_every_slot_but_the_last_sampled_token():
    full = torch.zeros(5, 2, 2, dtype=torch.int16)
    full[-1] = NO_ROUTE  # the last sampled token is never fed back: not counted
    assert completeness(_doc("replay", [full, full[:3].clone()])).verdict == PASS
    hole = full.clone()
    hole[1, 0, 1] = NO_ROUTE
    f = completeness(_doc("measure", [full, hole]))
    assert f.verdict == FAIL and f.figure == pytest.approx(15 / 16) and "1 of 16 token-layer slots" in f.cause
    assert completeness(_doc("replay", [])).verdict == FAIL  # asked for routes, none came
    assert completeness(_doc("off", [])).verdict == SKIP


def test_routing_is_registered_after_layers_and_a_dense_model_is_skipped_with_its_reason():
    assert [c.name for c in CHECKS][:2] == ["layers", "routing"]
    dense = SimpleNamespace(model=SimpleNamespace(config=transformers.LlamaConfig()))
    with pytest.raises(CheckCannotRun, match="llama: not a mixture-of-experts model"):
        run(dense)


@pytest.mark.slow
def test_the_moe_doctor_cases_pass_in_their_own_process():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:logging", str(CASES)], cwd=REPO,
                          capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
