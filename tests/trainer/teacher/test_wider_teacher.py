"""A teacher with more vocabulary rows than the student and the same tokenizer (Qwen2.5-7B's 152,064 beside the
1.5B's 151,936): accepted by the start check (trainer/lifecycle/teacher_checks.py) and scored correctly by the
teacher's engine and by the trainer's fused kernel (trainer/teacher/). Two tiny Llamas are built here with one
tokenizer (the built-in's 512 entries) and vocab sizes 512 and 576; the wider one puts real mass on its padding
rows, so what happens to that mass is visible."""
import math

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rollout.hf_engine import HFEngine
from rollout.support import Support
from rollout.types import Rollouts
from trainer.builtin.tiny import ensure_tiny_base
from trainer.config import RecipeError, RunConfig, TeacherConfig
from trainer.distributed.data_parallel import DataParallel
from trainer.lifecycle.teacher_checks import check_same_tokenizer
from trainer.models.batch import batch_from_rollouts
from trainer.teacher.scores import teacher_scores
from trainer.teacher.teacher import Teacher

STUDENT_VOCAB, TEACHER_VOCAB = 512, 576


def build(tokenizer_dir, out, vocab_size, seed, padding_logit=None):
    """A one-layer Llama of ``vocab_size`` rows with the tokenizer of ``tokenizer_dir``; ``padding_logit``: a bias
    that gives the rows beyond the tokenizer's entries a share of the mass."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if padding_logit is not None:
        with torch.no_grad():  # the padding rows' weights follow the hidden state's mean direction: large logits
            model.lm_head.weight[STUDENT_VOCAB:] = padding_logit
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tokenizer_dir = ensure_tiny_base()  # the built-ins' tokenizer (no warm start needed for it)
    root = tmp_path_factory.mktemp("vocab")
    student = build(tokenizer_dir, root / "student", STUDENT_VOCAB, seed=0)
    teacher = build(tokenizer_dir, root / "teacher", TEACHER_VOCAB, seed=1, padding_logit=0.02)
    return student, teacher


def test_a_wider_teacher_with_the_same_tokenizer_is_accepted_and_a_narrower_refused(models):
    student, teacher = models
    assert len(AutoTokenizer.from_pretrained(teacher)) == STUDENT_VOCAB  # the rows beyond are padding
    check_same_tokenizer(student, teacher, "wide")
    with pytest.raises(RecipeError, match=f"teacher.path = 'narrow': vocab_size {STUDENT_VOCAB} in its config.json; "
                                          f"expected at least the student's {TEACHER_VOCAB}"):
        check_same_tokenizer(teacher, student, "narrow")  # the roles swapped: ids 512..575 would have no row


@pytest.mark.parametrize("truncated", [False, True])
def test_the_wider_teacher_is_scored_over_its_own_vocabulary(models, truncated):
    """``truncated``: the student sampled with top-k / top-p (its kept sets on the batch); the teacher is still
    scored over its whole softmax on both sides."""
    _, teacher_dir = models
    completions = [[97, 98, 2], [260, 261, 262, 263]]
    support = [Support.from_lists([[t, t + 1, 5] for t in c]) for c in completions] if truncated else []
    rollouts = Rollouts(prompt_ids=[[1, 40, 41], [1, 300]], completion_ids=completions,
                        rollout_logprobs=[[-1.0, -2.0, -3.0], [-1.0, -1.5, -2.0, -2.5]],
                        finish_reasons=["stop", "length"], group_size=1, support=support)
    cfg = RunConfig()
    cfg.teacher = TeacherConfig(path=teacher_dir, dtype="float32", parity_every=1)
    teacher = Teacher(cfg, teacher_dir, HFEngine(teacher_dir, dtype="float32"), dp=DataParallel(), device="cpu")
    batch = batch_from_rollouts(rollouts, pad_id=0)
    assert (batch.support is not None) == truncated
    lp, metrics = teacher(1, rollouts, batch)

    # what the teacher's engine returns: log_softmax over all 576 rows, at the sampled ids
    model = LlamaForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    for k, (p, c) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_ids)):
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([p + c])).logits[0].double(), dim=-1)
        assert full.shape[-1] == TEACHER_VOCAB
        want = full[len(p) - 1:len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(lp[k, :len(c)].double(), want, atol=1e-5)
        # the teacher's mass on its padding rows is real here, and the student's ids hold the rest: the log-probs
        # are NOT renormalised over the student's 512 ids (the reward is off by log(kept mass), module docstring
        # of trainer/lifecycle/teacher_checks.py)
        kept = full[:, :STUDENT_VOCAB].exp().sum(-1)
        assert (kept < 0.99).all() and (kept > 0.01).all()
    # the trainer's fused kernel on the teacher (teacher_parity/*) reads the 576 rows the same way
    assert metrics["teacher_parity/num_tokens"] == 7 and metrics["teacher_parity/mae"] <= 1e-4
    assert math.isfinite(metrics["distill/reverse_kl"])
    # and the engine's scores laid out on the batch are the same through teacher_scores directly
    again, _ = teacher_scores(teacher.engine, rollouts, batch.mask.shape[1], "cpu")
    assert torch.equal(again, lp)
    teacher.close()
