"""Prefill vs decode: the engine's log-probs of the tokens it sampled, decoding one token per step, against the same
sequences scored in one prefill by the engine (its prompt log-probs), and both against the trainer.

All three at temperature 1 and without truncation (prompt log-probs are the raw distribution's). A decode that
differs from the engine's own prefill points at the decode kernels or the KV cache (paged attention, a KV cache in
another dtype); a prefill that differs from the trainer at the model itself (the next checks say where).
"""
from __future__ import annotations

from parity.metrics import compare
from rollout.types import Rollouts
from trainer.doctor.checks.layers import precision_refusal
from trainer.doctor.context import Doctor
from trainer.doctor.records import Check, at_most
from trainer.models.batch import batch_from_rollouts
from trainer.precision.verdict import MAE_WARN_FACTOR

NAME = "prefill_decode"


def _prefill_logprobs(doc: Doctor, r: Rollouts) -> Rollouts:
    """The same samples with the engine's prefill log-probs of their completion tokens in place of the decode's."""
    seqs = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
    scored = doc.engine.score(seqs)
    lps = [list(lp[len(p) - 1:]) for lp, p in zip(scored.logprobs, r.prompt_ids)]
    return Rollouts(prompt_ids=r.prompt_ids, completion_ids=r.completion_ids, rollout_logprobs=lps,
                    finish_reasons=r.finish_reasons, group_size=r.group_size)


def run(doc: Doctor) -> list:
    decoded = doc.engine.generate(doc.prompt_ids, doc.spec(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0))
    prefilled = _prefill_logprobs(doc, decoded)
    pad = doc.tokenizer.pad_token_id
    lp_d = batch_from_rollouts(decoded, pad, "cpu").rollout_logprobs.float()
    lp_p = batch_from_rollouts(prefilled, pad, "cpu").rollout_logprobs.float()
    lp_t, mask = doc.trainer_logprobs(decoded, temperature=1.0)
    level = doc.mae_level()
    why = precision_refusal(doc.precision, doc.dtype)  # where to look next: the layers check, where it runs
    where = "see the layers check" if why is None else "the layers check cannot say where (" + why + ")"
    pairs = {"decode vs prefill (engine)": (lp_d, lp_p, "the engine's decode path (paged attention, KV cache dtype, "
                                                        "decode kernels) computes what its own prefill does not"),
             "decode vs trainer": (lp_d, lp_t, "the engine's sampled log-probs differ from the trainer's beyond "
                                               f"this dtype's level: {where}"),
             "prefill vs trainer": (lp_p, lp_t, f"the engine's model differs from the trainer's on one prefill: "
                                                f"{where}")}
    out = []
    for item, (a, b, cause) in pairs.items():
        m = compare(a * mask, b * mask, mask)
        out.append(at_most(NAME, f"{item}: mae", m["parity/mae"], level, cause, warn_factor=MAE_WARN_FACTOR,
                           details={"max_abs": m["parity/max_abs"], "kl_k3": m["parity/kl_k3"],
                                    "tokens": int(mask.sum())}))
    return out


CHECK = Check(NAME, "do the engine's decode and prefill give the trainer's log-probs?", run)
