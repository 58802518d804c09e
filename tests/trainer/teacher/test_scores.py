"""The teacher engine's prompt log-probs laid out on the batch (trainer/teacher/scores.py), with a stand-in engine
whose answers are written out by hand."""
import pytest
import torch

from rollout.types import Rollouts, Scored
from trainer.teacher.scores import teacher_scores


class HandEngine:
    """Scores token t of a sequence as -t / 10 (a value that says which position it came from); top-1 id t + 100."""

    def __init__(self, drop: int = 0):
        self.drop, self.asked = drop, []

    def score(self, sequences, topk=0):
        self.asked.append((sequences, topk))
        rows = [([-x / 10 for x in seq[1:len(seq) - self.drop]], [[x + 100] for x in seq[1:]] if topk else [],
                 [[0.0] for _ in seq[1:]] if topk else []) for seq in sequences]
        return Scored.from_rows(rows)


ROLLOUTS = Rollouts(prompt_ids=[[1, 2, 3], [1, 4]], completion_ids=[[5, 6], [7, 8, 9]],
                    rollout_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]], finish_reasons=["stop", "length"],
                    group_size=1)


def test_completion_tokens_scored_on_the_ids_sampled():
    engine = HandEngine()
    lp, top1 = teacher_scores(engine, ROLLOUTS, 4, "cpu", top1=True)
    # the engine read prompt + completion ids exactly; each completion token's score is at its column
    assert engine.asked == [([[1, 2, 3, 5, 6], [1, 4, 7, 8, 9]], 1)]
    assert torch.allclose(lp, torch.tensor([[-0.5, -0.6, 0.0, 0.0], [-0.7, -0.8, -0.9, 0.0]]))
    assert torch.equal(top1, torch.tensor([[105, 106, -1, -1], [107, 108, 109, -1]]))
    lp2, none = teacher_scores(HandEngine(), ROLLOUTS, 3, "cpu")
    assert none is None and torch.equal(lp2, lp[:, :3])


def test_an_engine_that_returns_too_few_logprobs_is_refused():
    with pytest.raises(RuntimeError, match="returned 1 prompt log-probs for the 2 completion tokens of sequence 0"):
        teacher_scores(HandEngine(drop=1), ROLLOUTS, 3, "cpu")
