"""Sampling semantics: the engine's log-probs are those of the distribution it sampled from (temperature applied as
the trainer applies it: logits / T before the softmax; ``processed_logprobs``), and nothing in the model's
``generation_config.json`` changes that distribution behind the recipe's back.

- ``temperature``: the same tokens sampled at T = 0.7 are scored by the trainer at 0.7 and at 1; the engine's
  log-probs must match the scores at 0.7 within the dtype's parity level, and at most a third of their mismatch with
  the scores at 1. A FAIL means the engine returns the untempered distribution's log-probs (a ``logprobs_mode``
  other than ``processed_logprobs``) or applies no temperature to them.
- ``generation_config``: sampling fields a vLLM server applies by default (``--generation-config auto``) to any
  request that does not set them; parityrl's requests set temperature, top-p, top-k and min-p, so the others
  (repetition, presence and frequency penalties) would change what a server samples.
"""
from __future__ import annotations

import json
from pathlib import Path

from parity.metrics import compare
from trainer.doctor.context import Doctor
from trainer.doctor.records import PASS, WARN, Check, Finding, at_most
from trainer.models.batch import batch_from_rollouts

NAME = "sampling"
PROBE_T = 0.7
# Fields of generation_config.json that change the sampled distribution and that parityrl's requests do not set;
# the value at which each is off.
UNSET_BY_REQUESTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _temperature(doc: Doctor) -> list[Finding]:
    r = doc.engine.generate(doc.prompt_ids, doc.spec(temperature=PROBE_T, top_p=1.0, top_k=0, min_p=0.0))
    lp_r = batch_from_rollouts(r, doc.tokenizer.pad_token_id, "cpu").rollout_logprobs.float()
    at_t, mask = doc.trainer_logprobs(r, temperature=PROBE_T)
    at_1, _ = doc.trainer_logprobs(r, temperature=1.0)
    mae_t = compare(at_t, lp_r * mask, mask)["parity/mae"]
    mae_1 = compare(at_1, lp_r * mask, mask)["parity/mae"]
    cause = (f"the engine's log-probs match the trainer's at T = 1 (mae {mae_1:.3g}) better than at T = {PROBE_T}: "
             "it returns raw log-probs (logprobs_mode other than processed_logprobs) or applies no temperature"
             if mae_1 <= mae_t else f"the engine's log-probs at T = {PROBE_T} differ from the trainer's beyond this "
                                    "dtype's level")
    # the dtype's level, and well below the mismatch with the untempered scores: a third of it leaves room for a
    # deep BF16 model's level (SmolLM2-135M: 2.7e-2 at 0.7 against 2.5e-1 at 1) while raw log-probs (mae_t ~ mae_1
    # or above) fail
    return [at_most(NAME, f"temperature {PROBE_T}: mae vs trainer at {PROBE_T}", mae_t,
                    min(doc.mae_level(), mae_1 / 3), cause, details={"mae_vs_trainer_at_1": mae_1})]


def _generation_config(doc: Doctor) -> list[Finding]:
    path = Path(doc.model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    active = {k: config[k] for k, off in UNSET_BY_REQUESTS.items() if k in config and config[k] != off}
    server = doc.cfg.rollout.mode == "server"
    if not active:
        return [Finding(NAME, "generation_config: defaults a server would add", 0.0, "0", PASS)]
    return [Finding(NAME, "generation_config: defaults a server would add", float(len(active)), "0",
                    WARN, f"{path.name} sets {active}: a vLLM server applies them to every request that does not set "
                          f"them{' (this recipe trains against a server)' if server else ''}; start the server with "
                          "--generation-config vllm or set them off in the model's generation_config.json",
                    details=active)]


def run(doc: Doctor) -> list[Finding]:
    return _temperature(doc) + _generation_config(doc)


CHECK = Check(NAME, "do the engine's log-probs describe the distribution the trainer scores?", run)
