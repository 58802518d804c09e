"""What says a run went wrong, at its end: the summary's warning lines (``print_summary``), one per sign, each naming
what moved with it -- as far as the run's own records can tell, and no further.

The signs, over the run's first and last ``k`` steps (the summary's reward window) or its first and last held-out
evaluation:

- **held-out accuracy fell** (``eval/mean@k``, else ``eval/greedy``): by ``MIN_DROP`` or more, and by ``REL_DROP``
  of where it started. Below that an evaluation's own noise can move it: a mean@4 of 64 prompts near 0.05 has a
  standard error of 0.014 (256 samples), a greedy accuracy near 0.5 one of 0.06, which the relative margin covers.
- **training reward fell**: the same rule on ``reward/mean``.
- **tool use collapsed** (``episode/tool_calls``): to half or less of where it started, from at least 0.2 calls per
  episode.
- **entropy ran away** (``train/entropy``): doubled, and up by ``ENTROPY_RISE`` nats or more: the sampling
  distribution spreading, which is where a small model's samples turn to noise.
- **updates were skipped** (``train/skipped_updates``): a gradient that was not finite, whose update
  ``trainer/distributed/gradient_guard.py`` kept out of the weights; the steps are named.
- **the probe's mismatch grew** (``probe/mae``, the fixed prompts re-scored after each sync): ``PROBE_FACTOR`` (10x)
  or more over its first value after a sync (the one before step 1 where the run has fewer than two after one) -- the factor README.md and docs/troubleshooting.md give as "not rounding".

The cause each line names is only what the records show beside it: a mismatch that grew with the entropy is said to
have grown with it (a spreading distribution puts more tokens where the two sides' roundings disagree), and the
doctor on the last checkpoint is where a broken sync is told apart from that.
"""
from __future__ import annotations

from typing import Optional

MIN_DROP = 0.04
REL_DROP = 0.25
TOOL_FLOOR = 0.2  # calls per episode a collapse is counted from
ENTROPY_RISE = 0.2  # nats
PROBE_FACTOR = 10.0


def _mean(rows: list[dict], key: str) -> Optional[float]:
    xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(xs) / len(xs) if xs else None


def _fell(first: Optional[float], last: Optional[float]) -> bool:
    return first is not None and last is not None and first - last >= MIN_DROP and last <= (1 - REL_DROP) * first


def _eval_key(row: dict) -> Optional[str]:
    means = sorted(k for k in row if k.startswith("eval/mean@") and k.count("/") == 1)
    return means[0] if means else ("eval/greedy" if "eval/greedy" in row else None)


def held_out_fell(first_step: int, first: dict, step: int, now: dict) -> Optional[str]:
    """The warning when the held-out accuracy of ``step`` (record ``now``) fell from ``first_step``'s, else None:
    printed after the evaluation that shows it, and in the summary."""
    key = _eval_key(first)
    if key is None or not _fell(first.get(key), now.get(key)):
        return None
    return (f"warning: held-out {key[5:]} fell over the run, {first[key]:.3f} (step {first_step}) -> "
            f"{now[key]:.3f} (step {step}): the policy got worse at the task")


def health_warnings(h: list[dict], k: int, evals: dict[int, dict], probes: dict[int, float]) -> list[str]:
    """The summary's warning lines for a run whose per-step records are ``h`` (step 1 on), whose held-out records
    are ``evals`` and whose probe figures are ``probes`` (step -> record / ``probe/mae``; step 0: the weights
    training started from); [] when nothing went wrong."""
    if not h:
        return []
    head, tail = h[:k], h[-k:]
    window = f"first {k} / last {k} step(s)"
    entropy = (_mean(head, "train/entropy"), _mean(tail, "train/entropy"))
    entropy_ran = (None not in entropy and entropy[1] >= 2 * entropy[0]
                   and entropy[1] - entropy[0] >= ENTROPY_RISE)
    probe = [probes[s] for s in sorted(probes) if isinstance(probes[s], (int, float)) and probes[s] > 0]
    synced = [probes[s] for s in sorted(probes) if s >= 1 and isinstance(probes[s], (int, float)) and probes[s] > 0]
    # measured from the first probe after a sync where there are two: the probe before step 1 reads the engine's
    # starting weights, which a merged sync has not yet rounded (the HF engine there is the trainer's own
    # implementation: 1.5e-6, then 7.5e-3 after the first merged bf16 sync of a healthy run)
    probe = synced if len(synced) >= 2 else probe
    probe_grew = len(probe) >= 2 and probe[-1] >= PROBE_FACTOR * probe[0]
    out = []
    if len(evals) >= 2:
        fell = held_out_fell(min(evals), evals[min(evals)], max(evals), evals[max(evals)])
        if fell:
            out.append(f"{fell}; the lines below say what moved with it")
    reward = (_mean(head, "reward/mean"), _mean(tail, "reward/mean"))
    if _fell(*reward):
        out.append(f"warning: training reward fell, {reward[0]:.3f} -> {reward[1]:.3f} ({window})")
    calls = (_mean(head, "episode/tool_calls"), _mean(tail, "episode/tool_calls"))
    if None not in calls and calls[0] >= TOOL_FLOOR and calls[1] <= calls[0] / 2:
        out.append(f"warning: tool use collapsed, {calls[0]:.2f} -> {calls[1]:.2f} calls per episode ({window}): "
                   "the policy stopped calling the tool it was offered")
    if entropy_ran:
        out.append(f"warning: entropy ran away, {entropy[0]:.2f} -> {entropy[1]:.2f} nats per token ({window}): "
                   "the policy's samples are spreading toward noise; a lower train.learning_rate or a tighter clip "
                   "holds it (docs/troubleshooting.md)")
    skipped = [r.get("step") for r in h if (r.get("train/skipped_updates") or 0) > 0]
    if skipped:
        steps = ", ".join(str(x) for x in skipped[:8]) + (" ..." if len(skipped) > 8 else "")
        out.append(f"warning: {len(skipped)} of {len(h)} steps skipped an update whose gradient was not finite "
                   f"(steps {steps}): the weights did not move there; the console named the parameters")
    if probe_grew:
        why = ("it grew with the entropy, as a spreading distribution's mismatch does" if entropy_ran else
               "the entropy did not run away, so not a spreading distribution")
        out.append(f"warning: the probe's mismatch grew {probe[-1] / probe[0]:.0f}x, {probe[0]:.1e} -> "
                   f"{probe[-1]:.1e} (probe/mae; 10x or more is not rounding): {why}; `parityrl doctor` on the "
                   "last checkpoint tells a broken sync from that (docs/doctor.md)")
    return out
