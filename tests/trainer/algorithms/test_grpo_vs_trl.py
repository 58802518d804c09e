"""A differential test against TRL's GRPOTrainer: one batch, the same LoRA weights, two optimizer steps each.

TRL's side is its real training loop (``GRPOTrainer.train``: advantages from the rewards, ``_compute_loss`` with
``loss_type="dapo"``, Transformers' backward, clipping, optimizer and scheduler), fed a fixed batch through its
``rollout_func`` hook and a reward function that looks the rewards up. parityrl's side is its update pass
(``trainer.rl.update.policy_gradient_pass``, micro-batched), ``optimizer_step`` and the scheduler of
``trainer.models.optim``, with the optimizer ``trainer.rl.loop.setup`` builds. Both start from the same float32 model
and LoRA weights (B non-zero, so every adapter matrix gets a gradient) and see the batch twice, so the second step
also compares AdamW's moments and bias correction and the schedule's second learning rate.

What must agree to float32 rounding: the loss, the pre-clip gradients of every LoRA matrix (so the advantages, their
normaliser and the loss aggregation), the gradient norm, the learning rate of each step, the optimizer's settings,
and each step's update. The batch has completions that end with EOS and completions cut at the token limit (both
in the loss on both sides), prompts of several lengths (left padding), a group whose rewards are all equal, and a
micro-batch size that does not divide the batch.

The updates are compared in two ways, because AdamW's first steps move an element by about lr * g / (|g| + eps):
where |g| is near eps (1e-8) the update turns on the gradient's last bits, so float32 rounding of such an element's
gradient (the two sum tokens in different orders) moves its update by up to ~1e-3 lr, and the second step's
gradient inherits that. So: step 1's gradient elementwise to 1e-5 of its largest element and its update
elementwise to 1e-4 lr wherever |g| > 100 eps; step 2's gradient as a whole (the norm of the difference) to 1e-4 of
its norm; every update as a whole to 1e-3 of its norm. Measured (CPU, TRL 1.16.0, Transformers 5.19): step 1's
gradients 1.3e-6 of the largest element, its updates 3.6e-5 lr where |g| > 100 eps, step 2's gradient 1.2e-5, the
updates 2.7e-4 and 1.7e-4. A real difference of setting shows at these levels: the negative control gives parityrl
weight decay 0.01 (7e-6 = 3.6e-3 lr on step 1's update) and the comparison fails.

Needs TRL 1.16 (the ``dev`` extra; or ``.venv/bin/pip install --no-deps 'trl==1.16.*'``: its dependencies are
parityrl's own); skipped without it. It drives TRL's ``rollout_func`` hook (experimental in 1.16) and Transformers' ``Trainer._clip_grad_norm``.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import TrainerCallback

from trainer.algorithms import AdvantageInputs
from trainer.builtin.resolve import resolve_model_path
from trainer.distributed.deepspeed import optimizer_step
from trainer.lifecycle.preflight import load_recipe
from trainer.models.batch import build_token_batch
from trainer.models.optim import make_scheduler
from trainer.models.policy import add_lora, load_base_model, load_tokenizer
from trainer.rl.learner import Learner
from trainer.rl.update import policy_gradient_pass

pytest.importorskip("trl", reason="TRL is not installed (pip install --no-deps 'trl==1.16.*'): the differential "
                    "test against its GRPOTrainer needs it")

PROMPTS, GROUP, TOKENS, LR, STEPS = 4, 4, 24, 2e-3, 2
# the fourth group's rewards are all equal: no signal, advantage 0 on both sides
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def _batch(vocab: int, eos: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids per prompt, completion ids per sample): random ids, no special token except a final EOS."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(PROMPTS)]
    lengths = [TOKENS, 3, 17, 9, 1, TOKENS, 12, 6, 20, 2, TOKENS, 14, 8, 11, 5, TOKENS]
    completions = []
    for k, n in enumerate(lengths):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        if n < TOKENS or k == 0:  # ended by EOS; the other full-length ones were cut at the limit
            ids[-1] = eos
        completions.append(ids)
    return prompts, completions


def _lora_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def _lora_grads(model) -> dict[str, torch.Tensor]:
    """The gradient of each LoRA matrix, named as in ``get_peft_model_state_dict`` (no adapter name)."""
    return {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _settings(optimizer) -> list[dict]:
    """The distinct AdamW settings of the parameter groups (Transformers makes a group without weight decay for
    biases and norms): what the update depends on besides the gradient."""
    groups = [{k: g[k] for k in ("initial_lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")}
              for g in optimizer.param_groups]
    return [g for i, g in enumerate(groups) if g not in groups[:i]]


@pytest.fixture(scope="module")
def start():
    """The float32 base model's directory and the LoRA weights both trainers start from (B non-zero)."""
    model_dir = resolve_model_path("builtin:tiny-base")
    lora = load_recipe("recipes/grpo_tiny.yaml", check_paths=False).model.lora
    torch.manual_seed(0)
    model = add_lora(load_base_model(model_dir, "float32"), lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.02 if "lora_B" in n else 0.1)
    return model_dir, lora, model


def _parityrl(start, schedule: str, *sets: str) -> dict:
    model_dir, _, initial = start
    cfg = load_recipe("recipes/grpo_tiny.yaml", [
        "model.dtype=float32", f"algorithm.group_size={GROUP}", f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.max_new_tokens={TOKENS}", f"train.learning_rate={LR}", f"train.steps={STEPS}",
        f"train.lr_schedule={schedule}", "train.micro_batch_size=5", *sets], check_paths=False)
    model = copy.deepcopy(initial)
    tokenizer = load_tokenizer(model_dir)
    prompts, completions = _batch(model.config.vocab_size, tokenizer.eos_token_id)
    batch = build_token_batch([p for p in prompts for _ in range(GROUP)], completions, tokenizer.pad_token_id)
    a = cfg.algorithm
    advantages = a.record.advantage(AdvantageInputs(rewards=torch.tensor(REWARDS), mask=batch.mask, group_size=GROUP),
                                    a.options)
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    # the optimizer and scheduler as trainer.rl.loop.setup builds them
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
    scheduler = make_scheduler(optimizer, t.lr_schedule, t.warmup_steps, t.steps, t.warmup_ratio)
    accelerator = Accelerator(cpu=True)
    learner = Learner(cfg=cfg, model=model, backward=accelerator.backward)
    out = {"grads": [], "norms": [], "weights": [], "losses": [], "lrs": [], "settings": _settings(optimizer)}
    model.train()
    for _ in range(STEPS):
        _, metrics = policy_gradient_pass(learner, batch, advantages)
        out["grads"].append(_lora_grads(model))
        out["losses"].append(metrics["train/loss"])
        out["lrs"].append(scheduler.get_last_lr()[0])
        out["norms"].append(optimizer_step(accelerator, model, optimizer, params, t.max_grad_norm))
        scheduler.step()
        out["weights"].append(_lora_weights(model))
    return out


def _trl(start, schedule: str, tmp_path) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    model_dir, lora, initial = start
    tokenizer = load_tokenizer(model_dir)
    base = load_base_model(model_dir, "float32")
    prompts, completions = _batch(base.config.vocab_size, tokenizer.eos_token_id)
    # the batch reaches TRL through its rollout hook: each prompt's GROUP completions in order
    names = [f"prompt {i}" for i in range(PROMPTS)]
    reward_of = {tuple(c): r for c, r in zip(completions, REWARDS)}
    assert len(reward_of) == len(completions)  # the rewards are looked up by the completion's ids

    def rollout(batch_prompts, trainer):
        seen: dict[str, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for name in batch_prompts:
            i, j = names.index(name), seen.get(name, 0)
            seen[name] = j + 1
            out["prompt_ids"].append(prompts[i])
            out["completion_ids"].append(completions[i * GROUP + j])
            out["logprobs"].append([0.0] * len(completions[i * GROUP + j]))
        return out

    def reward(prompts, completions, completion_ids, **kw):
        return [reward_of[tuple(c)] for c in completion_ids]

    # the bench's configuration (bench/speed/bench_vs_trl.py trl_grpo) at this batch's size
    cfg = GRPOConfig(output_dir=str(tmp_path / "trl"), max_steps=STEPS, per_device_train_batch_size=PROMPTS * GROUP,
                     num_generations=GROUP, max_completion_length=TOKENS, learning_rate=LR, logging_steps=1,
                     report_to=[], save_strategy="no", bf16=False, use_cpu=True, use_vllm=False, beta=0.0,
                     temperature=1.0, loss_type="dapo", lr_scheduler_type=schedule, gradient_checkpointing=False,
                     seed=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")
        trainer = GRPOTrainer(model=base, reward_funcs=reward, args=cfg,
                              train_dataset=Dataset.from_dict({"prompt": names}), processing_class=tokenizer,
                              peft_config=LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules="all-linear"),
                              rollout_func=rollout)
    model = trainer.model
    start_weights = get_peft_model_state_dict(initial)
    assert set(get_peft_model_state_dict(model)) == set(start_weights)  # the same adapted layers
    set_peft_model_state_dict(model, start_weights)
    out = {"grads": [], "norms": [], "weights": [], "losses": [], "lrs": []}
    clip = trainer._clip_grad_norm

    def clip_and_record(m):  # called once per optimizer step, before clipping: the accumulated gradient
        out["grads"].append(_lora_grads(model))
        return clip(m)

    trainer._clip_grad_norm = clip_and_record

    class Record(TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
            out["weights"].append(_lora_weights(model))
            out["settings"] = _settings(optimizer)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "grad_norm" in logs:
                out["norms"].append(float(logs["grad_norm"]))
                out["losses"].append(float(logs["loss"]))
                out["lrs"].append(float(logs["learning_rate"]))

    trainer.add_callback(Record())
    trainer.train()
    return out


@pytest.fixture(scope="module")
def trl_runs(start, tmp_path_factory):
    """TRL's two steps per schedule, run once for the module."""
    runs: dict[str, dict] = {}

    def get(schedule: str) -> dict:
        if schedule not in runs:
            runs[schedule] = _trl(start, schedule, tmp_path_factory.mktemp(f"trl-{schedule}"))
        return runs[schedule]
    return get


def mismatches(ours: dict, theirs: dict, before: dict) -> list[str]:
    """Where parityrl's steps differ from TRL's beyond float32 rounding (the module docstring's criteria)."""
    bad = []
    if ours["settings"] != theirs["settings"]:
        bad.append(f"optimizer settings: {ours['settings']} vs TRL's {theirs['settings']}")
    if len(theirs["grads"]) != STEPS or len(theirs["weights"]) != STEPS or len(theirs["lrs"]) != STEPS:
        return bad + [f"TRL took {len(theirs['weights'])} optimizer steps, expected {STEPS}"]
    for step in range(STEPS):
        at = f"step {step + 1}"
        g_ours, g_theirs = ours["grads"][step], theirs["grads"][step]
        if not g_theirs or g_ours.keys() != g_theirs.keys():
            bad.append(f"{at}: the gradients are of other matrices")
            continue
        if step == 0:  # the same weights: every element
            for name, g in g_theirs.items():
                if not torch.allclose(g_ours[name], g, rtol=0, atol=1e-5 * float(g.abs().max()) + 1e-12):
                    bad.append(f"{at}: gradient of {name}: max |diff| {float((g_ours[name] - g).abs().max()):.3g}, "
                               f"max |g| {float(g.abs().max()):.3g}")
        else:  # weights that differ where step 1's update turned on rounding: the gradient as a whole
            diff = sum(float(((g_ours[n] - g) ** 2).sum()) for n, g in g_theirs.items()) ** 0.5
            size = sum(float((g ** 2).sum()) for g in g_theirs.values()) ** 0.5
            if diff > 1e-4 * size:
                bad.append(f"{at}: |gradient difference| / |gradient| = {diff / size:.3g}")
        if ours["norms"][step] != pytest.approx(theirs["norms"][step], rel=1e-5):
            bad.append(f"{at}: grad norm {ours['norms'][step]} vs TRL's {theirs['norms'][step]}")
        if ours["losses"][step] != pytest.approx(theirs["losses"][step], rel=1e-4, abs=1e-7):
            bad.append(f"{at}: loss {ours['losses'][step]} vs TRL's {theirs['losses'][step]}")
        if ours["lrs"][step] != pytest.approx(theirs["lrs"][step], rel=1e-6):
            bad.append(f"{at}: learning rate {ours['lrs'][step]} vs TRL's {theirs['lrs'][step]}")
        diff2 = norm2 = 0.0
        for name, w in theirs["weights"][step].items():
            d_ours, d_theirs = ours["weights"][step][name] - before[name], w - before[name]
            diff2 += float(((d_ours - d_theirs) ** 2).sum())
            norm2 += float((d_theirs ** 2).sum())
            if step == 0:
                sure = g_theirs[name].abs() > 100 * theirs["settings"][0]["eps"]  # well away from eps
                worst = float((d_ours - d_theirs).abs()[sure].max()) if sure.any() else 0.0
                if worst > 1e-4 * LR:
                    bad.append(f"{at}: update of {name} where |g| > 100 eps: max |diff| {worst:.3g} (lr {LR})")
        if diff2 ** 0.5 > 1e-3 * norm2 ** 0.5:
            bad.append(f"{at}: |update difference| / |update| = {(diff2 / norm2) ** 0.5:.3g}")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_one_batch_gives_trls_gradients_and_updates(start, trl_runs, schedule):
    before = _lora_weights(start[2])
    assert mismatches(_parityrl(start, schedule), trl_runs(schedule), before) == []


@pytest.mark.slow
def test_the_comparison_sees_a_setting_that_differs(start, trl_runs):
    """Negative control: parityrl with weight decay 0.01 (Transformers' default is 0) must be told apart, by its
    optimizer settings and by its updates, while its gradients at the shared starting weights still agree."""
    before = _lora_weights(start[2])
    bad = mismatches(_parityrl(start, "constant", "train.weight_decay=0.01"), trl_runs("constant"), before)
    assert any(b.startswith("optimizer settings") for b in bad)
    assert any("step 1: update of" in b for b in bad)
    assert not any(b.startswith("step 1: gradient") for b in bad)
