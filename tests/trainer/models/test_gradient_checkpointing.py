"""``train.gradient_checkpointing``: the same gradients as without it, and fewer activations kept for the backward.

On a random float32 Llama (std 0.2, so that the layers are far from the identity), loaded by the RL
loop's own ``load_policy``, through ``policy_gradient_pass`` (the loop's update pass, with GRPO's KL
term: the reference pass runs with the adapter off between the forward and the recompute), and
through ``completion_hidden`` with PPO's value head. Memory is counted as the bytes of the tensors
autograd saves for the backward (``saved_tensors_hooks``), not timed.
"""
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from trainer.algorithms import AdvantageInputs
from trainer.config.schema import RecipeError
from trainer.config.supervised import SFTTrainConfig
from trainer.lifecycle.preflight import load_recipe
from trainer.models.batch import build_token_batch
from trainer.models.checkpointing import checkpointing_enabled, enable_gradient_checkpointing
from trainer.models.policy import completion_hidden
from trainer.rl.learner import Learner, load_policy
from trainer.rl.update import policy_gradient_pass
from trainer.rl.value_head import ValueHead
from trainer.supervised.hf_trainer import LossModule, training_arguments

REPO = Path(__file__).resolve().parents[3]
LAYERS, HIDDEN = 3, 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("gc_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def policy(model_dir: str, checkpointing: bool, algorithm: str = "grpo"):
    sets = ["model.dtype=float32", f"algorithm.name={algorithm}", "algorithm.group_size=2",
            "train.micro_batch_size=3", f"train.gradient_checkpointing={str(checkpointing).lower()}"]
    if algorithm == "grpo":
        sets.append("algorithm.kl_coef=0.1")  # the reference pass (adapter off) runs inside the update
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", sets)
    torch.manual_seed(1)
    model = load_policy(cfg, Accelerator(cpu=True), model_dir)
    with torch.no_grad():  # a non-zero adapter: with B = 0 the A matrices get no gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return cfg, model.train()


def batch():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 3, 4, 5, 2, 4)]
    completions = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 2, 7, 4, 5, 3)]
    b = build_token_batch(prompts, completions, pad_id=0)
    b.rollout_logprobs = -torch.rand(b.mask.shape, generator=g) * b.mask
    return b


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn`` runs (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_update_pass_gradients_are_the_same_with_checkpointing(model_dir):
    b = batch()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    out = {}
    for on in (False, True):
        cfg, model = policy(model_dir, on)
        assert checkpointing_enabled(model) is on
        adv = cfg.algorithm.record.advantage(AdvantageInputs(rewards=rewards, mask=b.mask, group_size=2),
                                             cfg.algorithm.options)
        learner = Learner(cfg=cfg, model=model, backward=lambda loss: loss.backward())
        scores, metrics = policy_gradient_pass(learner, b, adv)
        out[on] = scores.logprobs, metrics["train/loss"], grads(model)
    (lp0, loss0, g0), (lp1, loss1, g1) = out[False], out[True]
    assert torch.equal(lp0, lp1)
    assert loss0 == pytest.approx(loss1, abs=1e-7)
    assert g0.keys() == g1.keys() and len(g0) == LAYERS * 7 * 2  # every all-linear adapter's A and B
    for name in g0:
        assert g0[name].abs().max() > 0, name
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)


def test_critic_gradients_are_the_same_and_fewer_activations_are_kept(model_dir):
    b = batch()
    res = {}
    for on in (False, True):
        _, model = policy(model_dir, on, algorithm="ppo")
        torch.manual_seed(2)
        head = ValueHead(HIDDEN)

        def forward(model=model, head=head):
            hidden, lm_head, values = completion_hidden(model, b, value_head=head)
            logits = hidden @ lm_head.weight.T
            return (torch.log_softmax(logits, -1).amax(-1) * b.mask).sum() + (values * b.mask).square().sum()

        nbytes, loss = saved_bytes(forward)
        loss.backward()
        res[on] = nbytes, {**grads(model), **{f"head.{n}": p.grad for n, p in head.named_parameters()}}
    (bytes0, g0), (bytes1, g1) = res[False], res[True]
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)
    # The checkpoint also holds each decoder layer's input ([S, T, H] float32) outside autograd's
    # saved tensors: count it against the checkpointed side.
    layer_inputs = LAYERS * b.input_ids.numel() * HIDDEN * 4
    assert bytes1 + layer_inputs < 0.5 * bytes0, (bytes0, bytes1, layer_inputs)


def test_eval_mode_and_no_grad_passes_keep_their_behaviour(model_dir):
    _, model = policy(model_dir, True)
    b = batch()

    def forward():
        hidden, _, _ = completion_hidden(model, b)
        return hidden.sum()

    train_bytes, _ = saved_bytes(forward)
    model.eval()  # Transformers checkpoints only in train mode: eval saves everything, as without it
    eval_bytes, _ = saved_bytes(forward)
    assert eval_bytes > 2 * train_bytes
    model.train()
    with torch.no_grad():
        with model.disable_adapter():  # the reference pass
            ref, _, _ = completion_hidden(model, b)
    _, plain = policy(model_dir, False)
    with torch.no_grad(), plain.disable_adapter():
        torch.testing.assert_close(ref, completion_hidden(plain, b)[0], atol=0, rtol=0)


def test_supervised_stages_turn_it_on_through_the_trainer(model_dir, tmp_path):
    args = training_arguments(SFTTrainConfig(gradient_checkpointing=True), tmp_path)
    assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert not training_arguments(SFTTrainConfig(), tmp_path).gradient_checkpointing
    _, model = policy(model_dir, False)
    module = LossModule(model, loss_fn=lambda m, x: (torch.zeros(()), {}))
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # what Trainer calls
    assert checkpointing_enabled(model)


def test_a_model_without_checkpointing_support_is_refused():
    class NoCheckpointing(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(RecipeError, match="train.gradient_checkpointing = true: NoCheckpointing"):
        enable_gradient_checkpointing(NoCheckpointing())
