"""The teacher of on-policy distillation: a second model, with the student's tokenizer, that scores the student's
sampled ids (``teacher.py``), the checks it must pass before training (``checks.py``), how its engine's log-probs
are laid out on the step's batch (``scores.py``) and what is measured of it (``metrics.py``: ``distill/*``,
``teacher_parity/*``). docs/distillation.md."""
