"""What a teacher must be before training starts: a model that reads the student's ids as the student does.

The distillation signal log pi_s(y_t) - log pi_t(y_t) compares the two models' probabilities of the same id; if an
id names another string for the teacher (another vocabulary), or the teacher has no row for it (a smaller vocab
size), the difference is meaningless. Both are refused with the reason, before any engine starts, as is a dense
teacher on a colocated vLLM engine beside an MoE student (``check_engine_order``: vLLM's parallel groups).

A teacher with MORE rows than the student (Qwen2.5-7B and larger: 152,064; 0.5B-3B: 151,936; one tokenizer of
151,665 entries) is accepted when the tokenizers agree: the student samples ids below its own vocab size, every one
of which the teacher has a row for, and the rows beyond are padding no tokenizer string maps to. The teacher's
log-probs stay normalised over its own vocabulary, so whatever mass it puts on those padding rows (close to none in
a trained model) is mass the student cannot match: the per-token reward is then the reverse KL to the teacher
restricted to the student's ids, off by log(teacher mass on them) <= 0, a function of the prefix only. With the
default discount 0 that term is a baseline of each token (it leaves the expected gradient, the one toward the
teacher renormalised over the student's ids, unchanged); with a discount > 0 later tokens' terms enter a token's
return (``distill/reverse_kl`` counts it either way).
"""
from __future__ import annotations

from transformers import AutoConfig

from rollout.moe_config import is_moe
from trainer.builtin.resolve import model_dir_at_hand
from trainer.config import RecipeError, RunConfig
from trainer.models.policy import load_tokenizer


def _vocab_size(model_dir: str):
    text = AutoConfig.from_pretrained(model_dir)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    return getattr(text, "vocab_size", None)


def check_same_tokenizer(student_dir: str, teacher_dir: str, teacher_path: str, where: str = "<recipe>") -> None:
    """RecipeError naming ``teacher.path`` unless the teacher's tokenizer maps every string to the id the student's
    does (same vocabulary, same special tokens) and its model has at least the student's vocab size (lm_head rows:
    a row for every id the student can sample; more are padding, module docstring)."""
    s_tok, t_tok = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    s_vocab, t_vocab = s_tok.get_vocab(), t_tok.get_vocab()
    if s_vocab != t_vocab:
        differ = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=lambda kv: kv[1])
        raise RecipeError(f"{where}: teacher.path = {teacher_path!r}: expected the student's tokenizer "
                          f"(model.path's); its vocabulary differs ({len(t_vocab)} vs {len(s_vocab)} entries, e.g. "
                          f"{differ[0][0]!r} -> {differ[0][1]}): distillation compares both models' log-probs of "
                          "the same ids")
    specials = ("eos_token_id", "bos_token_id", "pad_token_id")
    if any(getattr(s_tok, k) != getattr(t_tok, k) for k in specials):
        got = {k: getattr(t_tok, k) for k in specials}
        want = {k: getattr(s_tok, k) for k in specials}
        raise RecipeError(f"{where}: teacher.path = {teacher_path!r}: special token ids {got}; expected the "
                          f"student's {want}")
    s_size, t_size = _vocab_size(student_dir), _vocab_size(teacher_dir)
    if t_size != s_size and not (isinstance(s_size, int) and isinstance(t_size, int) and t_size > s_size):
        raise RecipeError(f"{where}: teacher.path = {teacher_path!r}: vocab_size {t_size} in its config.json; "
                          f"expected at least the student's {s_size} (the teacher must score every id the student "
                          "samples)")


def check_engine_order(cfg: RunConfig, student_dir: str, teacher_dir: str, where: str = "<recipe>") -> None:
    """RecipeError naming ``teacher.path`` for a dense teacher on a colocated vLLM engine beside an MoE student's.

    The teacher's engine starts first (``trainer/rl/loop.py: setup``), and vLLM's parallel groups are process-wide,
    made by the first engine: a dense model's leave out the expert-parallel group, and the MoE student's engine
    would then fail in its model's construction ("expert parallel group is not initialized";
    ``rollout.vllm_engine.VLLMEngine._refuse_moe_beside_a_dense_engine`` says so at that point, after the
    teacher has loaded). An MoE teacher beside a dense student, or two MoE models, start in that order."""
    t, r = cfg.teacher, cfg.rollout
    if not (t.engine == "vllm" and r.engine == "vllm" and r.mode == "colocate"):
        return
    if is_moe(AutoConfig.from_pretrained(student_dir)) and not is_moe(AutoConfig.from_pretrained(teacher_dir)):
        raise RecipeError(f"{where}: teacher.path = {t.path!r}: a dense teacher on a colocated vLLM engine "
                          f"(teacher.engine vllm) cannot run beside the mixture-of-experts student (model.path "
                          f"{cfg.model.path!r}): the teacher's engine starts first and vLLM's process-wide parallel "
                          "groups would lack the student's expert-parallel group; expected teacher.engine hf, "
                          "server or vllm_url")


def check_teacher_at_hand(cfg: RunConfig, where: str) -> None:
    """``check_same_tokenizer`` before training (a recipe's checks, ``--print-config``) when both models are here
    already: local directories, or built-ins once built. Nothing is built or downloaded for it, as the student's own
    checks there build nothing; a model not at hand is checked when training starts (``Teacher.from_config``)."""
    if not cfg.teacher.path:
        return
    student, teacher = model_dir_at_hand(cfg.model.path), model_dir_at_hand(cfg.teacher.path)
    if student is not None and teacher is not None:
        check_same_tokenizer(student, teacher, cfg.teacher.path, where)
        check_engine_order(cfg, student, teacher, where)
