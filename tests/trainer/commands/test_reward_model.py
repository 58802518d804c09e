"""Reward models (trainer/rewards/reward_model.py, trainer/rewards/sources.py, trainer/supervised/reward_model.py,
trainer/commands/train_rm.py): pooling, loss, scorer, reward sources, recipe, train-rm."""
import json
import math
from pathlib import Path

import pytest
import torch

from trainer.cli import main as cli_main
from trainer.commands.train_rm import load_rm_recipe, run_train_rm
from trainer.config import RecipeError, RewardConfig, RewardModelEntry
from trainer.lifecycle.preflight import load_recipe
from trainer.rewards.functions import compute_rewards
from trainer.rewards.reward_model import (
    RM_INFO_FILE,
    RewardModelScorer,
    last_token_index,
    pad_sequences,
    render_ids,
    sequence_scores,
)
from trainer.rewards.sources import build_reward_sources
from trainer.supervised.pairs import load_preference_pairs, pair_metrics, pairwise_loss
from trainer.supervised.reward_model import load_model_for_rm_training

REPO = Path(__file__).resolve().parents[3]


def _tiny_config(vocab_size: int, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kw)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from trainer.models.policy import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tokenizer) -> Path:
    """A small random 1-output reward model (float32) with the built-in tokenizer, saved like train-rm does."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(_tiny_config(len(tokenizer), num_labels=1))
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, not 0.02
    d = tmp_path_factory.mktemp("rm") / "model"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    (d / RM_INFO_FILE).write_text(json.dumps({"use_chat_template": True}))
    return d


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory, tokenizer) -> Path:
    """A small random causal LM: what train-rm starts from."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    d = tmp_path_factory.mktemp("lm") / "model"
    LlamaForCausalLM(_tiny_config(len(tokenizer))).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


PROMPTS = ["Tom has 3 pens and finds 5 more. How many pens does Tom have?",
           "Mia has 7 coins and loses 2. How many coins does Mia have left?",
           "Zoe has 12 eggs and eats 11. How many eggs does Zoe have left?"]
COMPLETIONS = ["3 + 5 = 8. The answer is 8.", "The answer is 5.", "12 - 11 = 1. The answer is 1. Well, maybe 2."]


# --------------------------------------------------------------------------- pooling and padding


def test_last_token_index_left_and_right():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert last_token_index(right).tolist() == [2, 4, 0]
    assert last_token_index(left).tolist() == [4, 4, 4]
    with pytest.raises(ValueError, match="no real token"):
        last_token_index(torch.tensor([[1, 1], [0, 0]]))


def test_pad_sequences_layout():
    ids, mask, pos = pad_sequences([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]  # RoPE positions restart at the first real token
    ids, mask, pos = pad_sequences([[5, 6, 7], [8]], pad_id=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_score_is_read_at_the_last_real_token_whatever_the_padding(rm_dir, tokenizer):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    seqs = render_ids(tokenizer, PROMPTS, COMPLETIONS, use_chat_template=True, max_tokens=None)
    assert len({len(s) for s in seqs}) == 3  # different lengths: real padding on both sides
    with torch.no_grad():
        alone = torch.cat([sequence_scores(model, *pad_sequences([s], 0)) for s in seqs])
        right = sequence_scores(model, *pad_sequences(seqs, 0, side="right"))
        left = sequence_scores(model, *pad_sequences(seqs, 0, side="left"))
        # HF's own convention (rightmost token != config.pad_token_id) on the right-padded batch
        ids, mask, _ = pad_sequences(seqs, 0, side="right")
        native = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    assert alone.std() > 0.05  # the scores differ between samples, so equal scores below are not trivial
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native, alone, atol=1e-5, rtol=1e-5)


def test_render_ids_is_the_trainers_prompt_then_completion_then_eos(tokenizer):
    from trainer.data.datasets import encode_prompts

    ids = render_ids(tokenizer, PROMPTS[:1], COMPLETIONS[:1], use_chat_template=True, max_tokens=None)[0]
    prompt = encode_prompts(tokenizer, PROMPTS[:1], use_chat_template=True)[0]
    assert ids[:len(prompt)] == prompt and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[len(prompt):-1]) == COMPLETIONS[0]
    full = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]},
                                          {"role": "assistant", "content": COMPLETIONS[0]}], tokenize=False)
    assert tokenizer.decode(ids) == full  # a finished assistant turn, as the chat template writes it
    lengths = [len(x) for x in render_ids(tokenizer, PROMPTS, COMPLETIONS, use_chat_template=True, max_tokens=None)]
    assert lengths[2] > max(lengths[:2])  # only the last sample is over the limit below
    with pytest.raises(ValueError, match=rf"rm 'x': sample 2: .* is {lengths[2]} tokens, more than max_tokens = 40"):
        render_ids(tokenizer, PROMPTS, COMPLETIONS, use_chat_template=True, max_tokens=40, where="rm 'x'")


# --------------------------------------------------------------------------- loss


def test_pairwise_loss_values():
    rc = torch.tensor([0.0, 2.0, -1.0, 100.0, -100.0])
    rr = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    per_pair = [math.log(2), math.log(1 + math.exp(-2)), math.log(1 + math.exp(2)), 0.0, 100.0]
    assert pairwise_loss(rc, rr).item() == pytest.approx(sum(per_pair) / 5, rel=1e-5)
    assert torch.isfinite(pairwise_loss(torch.tensor([-1e4]), torch.tensor([1e4])))
    m = pair_metrics(rc, rr)
    assert m["accuracy"] == pytest.approx(2 / 5)  # the tie (0 vs 0) counts as wrong
    assert m["margin"] == pytest.approx((0 + 2 - 2 + 100 - 100) / 5)


def test_gradient_raises_the_chosen_and_lowers_the_rejected():
    rc = torch.tensor([0.5], requires_grad=True)
    rr = torch.tensor([0.7], requires_grad=True)
    pairwise_loss(rc, rr).backward()
    # d/d r_c = -sigmoid(r_r - r_c); a descent step raises r_c and lowers r_r by the same amount
    assert rc.grad.item() == pytest.approx(-torch.sigmoid(torch.tensor(0.2)).item())
    assert rr.grad.item() == pytest.approx(-rc.grad.item())


# --------------------------------------------------------------------------- the scorer as a reward source


def test_scorer_batches_subtracts_the_baseline_and_ignores_columns(rm_dir):
    one = RewardModelScorer(rm_dir, batch_size=1)
    two = RewardModelScorer(rm_dir, batch_size=2, baseline=0.75)
    raw = one(PROMPTS, COMPLETIONS, answer=["8", "5", "1"])
    assert len(raw) == 3 and all(isinstance(x, float) for x in raw)
    assert two(PROMPTS, COMPLETIONS) == pytest.approx([r - 0.75 for r in raw], abs=1e-5)
    assert not any(p.requires_grad for p in one.model.parameters()) and not one.model.training


def test_scorer_refuses_bad_models(tmp_path, rm_dir, causal_dir, tokenizer):
    from transformers import LlamaForSequenceClassification

    with pytest.raises(FileNotFoundError, match="no config.json"):
        RewardModelScorer(tmp_path, name="rm")
    d = tmp_path / "three_labels"
    LlamaForSequenceClassification(_tiny_config(len(tokenizer), num_labels=3)).save_pretrained(d)
    tokenizer.save_pretrained(d)
    with pytest.raises(ValueError, match="num_labels = 3"):
        RewardModelScorer(d, name="rm")
    with pytest.raises(ValueError, match="baseline = nan"):
        RewardModelScorer(rm_dir, baseline=float("nan"))
    with pytest.raises(ValueError, match="max_tokens = 1000"):
        RewardModelScorer(rm_dir, max_tokens=1000)


def test_nan_scores_are_refused_naming_the_source_and_sample(rm_dir):
    scorer = RewardModelScorer(rm_dir, name="rm")
    with torch.no_grad():
        scorer.model.score.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"reward function 'rm' returned nan at sample 0"):
        compute_rewards({"rm": scorer}, {}, PROMPTS, COMPLETIONS, {})


def test_build_reward_sources_merges_rules_and_models(rm_dir):
    reward = RewardConfig(functions={"exact": "trainer.data.tasks.arithmetic:exact_answer_reward"},
                          models={"rm": RewardModelEntry(path=str(rm_dir), batch_size=2, baseline=0.5)},
                          weights={"rm": 0.25})
    fns, weights = build_reward_sources(reward, "cpu")
    assert list(fns) == ["exact", "rm"] and weights == {"exact": 1.0, "rm": 0.25}
    total, per = compute_rewards(fns, weights, PROMPTS, COMPLETIONS, {"answer": ["8", "5", "2"]})
    assert per["exact"] == [1.0, 1.0, 0.0]
    raw = RewardModelScorer(rm_dir).score(PROMPTS, COMPLETIONS)
    assert per["rm"] == pytest.approx([r - 0.5 for r in raw], abs=1e-5)
    assert total == pytest.approx([e + 0.25 * r for e, r in zip(per["exact"], per["rm"])])
    clash = RewardConfig(functions={"rm": "trainer.data.tasks.arithmetic:format_reward"},
                         models={"rm": RewardModelEntry(path=str(rm_dir))})
    with pytest.raises(ValueError, match=r"\['rm'\] are used by both"):
        build_reward_sources(clash, "cpu")
    with pytest.raises(ValueError, match="neither reward.functions nor reward.models"):
        build_reward_sources(RewardConfig(weights={"typo": 1.0}), "cpu")


# --------------------------------------------------------------------------- recipes


def _rl_recipe(tmp_path, text: str) -> Path:
    p = tmp_path / "rl.yaml"
    p.write_text("model: {path: builtin:tiny}\n" + text)
    return p


def test_rl_recipe_reward_models_are_validated(tmp_path, rm_dir):
    cfg = load_recipe(_rl_recipe(tmp_path, f"reward: {{functions: {{}}, models: {{rm: {{path: {rm_dir}}}}}, "
                                           "weights: {rm: 2.0}}\n"))
    assert cfg.reward.models["rm"].path == str(rm_dir) and cfg.reward.models["rm"].baseline == 0.0
    bad = {
        "reward: {models: {rm: {path: /nowhere}}}": "reward.models.rm.path = '/nowhere': expected a local reward-model",
        f"reward: {{models: {{rm: {{path: {rm_dir}, batch_size: 0}}}}}}": "reward.models.rm.batch_size = 0",
        f"reward: {{models: {{rm: {{path: {rm_dir}, max_tokens: 20}}}}}}": "reward.models.rm.max_tokens = 20: expected null or at least",
        f"reward: {{models: {{exact_answer: {{path: {rm_dir}}}}}}}": "reward.models.exact_answer",
        f"reward: {{models: {{rm: {{path: {rm_dir}, size: 3}}}}}}": "unknown key 'reward.models.rm.size'",
        "reward: {functions: {}}": "reward.functions = {}: expected at least one name",
        "reward: {weights: {rm: 1.0}}": "reward.weights.rm = 1.0: expected a weight for a name listed in reward.functions or reward.models",
    }
    for text, needle in bad.items():
        with pytest.raises(RecipeError) as e:
            load_recipe(_rl_recipe(tmp_path, text + "\n"))
        assert needle in str(e.value) and "rl.yaml" in str(e.value), (text, str(e.value))


def test_shipped_rm_recipe_validates():
    cfg = load_rm_recipe(REPO / "recipes" / "rm_tiny.yaml", check_paths=False)
    assert cfg.name == "rm_tiny" and cfg.model.lora.enabled and cfg.data.eval_split == "test"


def test_rm_recipe_errors_name_key_and_value(tmp_path):
    single = tmp_path / "prefs.jsonl"
    single.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    cases = {
        f"data: {{source: {single}}}": "data.eval_split = 'test': expected null for",
        "data: {eval_split: train}": "data.eval_split = 'train': expected a split other than data.split",
        "data: {eval_split: null, eval_fraction: 1.5}": "data.eval_fraction = 1.5",
        "data: {chosen_column: prompt}": "expected three different columns",
        "data: {max_tokens: 1000}": "data.max_tokens = 1000: expected at most the model's context of 256",
        "train: {batch_size: 0}": "train.batch_size = 0",
        "train: {lr_schedule: step}": "train.lr_schedule = 'step'",
        "model: {path: /no/such/model}": "model.path = '/no/such/model': no such directory",
    }
    for text, needle in cases.items():
        p = tmp_path / "rm.yaml"
        p.write_text(text + "\n")
        with pytest.raises(RecipeError) as e:
            load_rm_recipe(p)
        assert needle in str(e.value) and str(p) in str(e.value), (text, str(e.value))


def test_train_rm_cli_exits_2_on_bad_recipe_and_existing_output(tmp_path, capsys):
    p = tmp_path / "rm.yaml"
    p.write_text("train: {steps: 0}\n")
    assert cli_main(["train-rm", str(p)]) == 2
    assert "invalid recipe" in capsys.readouterr().err
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli_main(["train-rm", str(REPO / "recipes" / "rm_tiny.yaml"), "--set", f"output_dir={out}"]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "x"


# --------------------------------------------------------------------------- training


def test_lora_seq_cls_trains_the_new_score_head_and_merge_keeps_it(causal_dir, tokenizer):
    cfg = load_rm_recipe(REPO / "recipes" / "rm_tiny.yaml", ["model.dtype=float32"], check_paths=False)
    model = load_model_for_rm_training(str(causal_dir), cfg, tokenizer, "cpu")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable) and any("lora_" in n for n in trainable)
    assert not any("embed_tokens" in n for n in trainable)
    seqs = render_ids(tokenizer, PROMPTS, COMPLETIONS, use_chat_template=True, max_tokens=None)
    batch = pad_sequences(seqs, tokenizer.pad_token_id)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    head_before = model.get_base_model().score.modules_to_save["default"].weight.detach().clone()
    pairwise_loss(*sequence_scores(model, *batch)[:2].split(1)).backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        peft_scores = sequence_scores(model, *batch)
    head_after = model.get_base_model().score.modules_to_save["default"].weight.detach()
    assert not torch.equal(head_before, head_after)
    merged = model.merge_and_unload()
    assert isinstance(merged.score, torch.nn.Linear) and torch.equal(merged.score.weight, head_after)
    with torch.no_grad():
        torch.testing.assert_close(sequence_scores(merged, *batch), peft_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_train_rm_few_steps_writes_a_loadable_reward_model(tmp_path, tiny_model_dir):
    out = tmp_path / "rm"
    cfg = load_rm_recipe(REPO / "recipes" / "rm_tiny.yaml",
                         [f"output_dir={out}", f"logging.run_dir={tmp_path / 'run'}", "train.steps=4", "train.batch_size=4", "train.eval_every=2",
                          "data.num_examples=64", "data.num_eval_examples=16"])
    assert run_train_rm(cfg) == out
    assert {"config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", RM_INFO_FILE} <= {
        p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".rm.tmp-*"))  # the temporary directory was renamed, not left behind
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert all(r["eval/num_pairs"] == 16 and 0 <= r["eval/accuracy"] <= 1 for r in rows)
    assert "train/loss" in rows[-1] and "train/loss" not in rows[0]
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(out)
    assert conf.num_labels == 1 and conf.pad_token_id == 0
    assert conf.architectures == ["LlamaForSequenceClassification"]
    # The saved (merged, bf16) model, read back as a reward source, reproduces the last evaluation.
    _, held = load_preference_pairs(cfg)
    scorer = RewardModelScorer(out)
    assert next(scorer.model.parameters()).dtype == torch.bfloat16 and scorer.model.score.weight.dtype == torch.float32
    rc = torch.tensor(scorer.score(held["prompt"], held["chosen"]))
    rr = torch.tensor(scorer.score(held["prompt"], held["rejected"]))
    assert (rc - rr).mean().item() == pytest.approx(rows[-1]["eval/margin"], abs=0.05)
