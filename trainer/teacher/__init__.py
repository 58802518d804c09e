"""The teacher of on-policy distillation: a second model, with the student's tokenizer, that scores the student's
sampled ids (``teacher.py``; its tokenizer check before training is ``trainer.lifecycle.teacher_checks``, with the
recipe's other checks), how its engine's log-probs
are laid out on the step's batch (``scores.py``) and what is measured of it (``metrics.py``: ``distill/*``,
``teacher_parity/*``). docs/distillation.md."""
