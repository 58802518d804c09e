import random

import pytest
import torch

from trainer.config import LoraConfig
from trainer.io import checkpoint as ckpt
from trainer.models.optim import make_scheduler
from trainer.models.policy import add_lora


def tiny_peft(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=32)
    model = add_lora(LlamaForCausalLM(conf), LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = make_scheduler(opt, "cosine", 2, 10)
    return model, opt, sched


def one_step(model, opt, sched):
    ids = torch.randint(0, 64, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def lora_state(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def test_round_trip_restores_weights_optimizer_scheduler_rng(tmp_path):
    model, opt, sched = tiny_peft(0)
    for _ in range(3):
        one_step(model, opt, sched)
    random.seed(123)
    torch.manual_seed(7)
    path = ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, scheduler=sched, state={"batcher": {"pos": 5}},
                                keep_last=2)
    expected_next = (random.random(), torch.rand(1).item())
    saved = lora_state(model)

    model2, opt2, sched2 = tiny_peft(1)  # different init: everything must come from the checkpoint
    state = ckpt.load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert state["step"] == 3 and state["batcher"] == {"pos": 5}
    for k, v in lora_state(model2).items():
        assert torch.equal(v, saved[k]), k
    assert sched2.last_epoch == sched.last_epoch and sched2.get_last_lr() == sched.get_last_lr()
    assert (random.random(), torch.rand(1).item()) == expected_next
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)


def test_prunes_old_and_ignores_incomplete(tmp_path):
    model, opt, sched = tiny_peft(0)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model=model, optimizer=opt, scheduler=sched, state={}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    # a kill mid-write leaves a temp dir and possibly a step dir without its state.json
    (ckpt.checkpoints_dir(tmp_path) / ".tmp_step_000004_999").mkdir()
    (ckpt.checkpoints_dir(tmp_path) / "step_000005").mkdir()
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000003"


def test_load_incomplete_is_an_error(tmp_path):
    model, opt, sched = tiny_peft(0)
    (tmp_path / "step_000001").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "step_000001", model=model, optimizer=opt, scheduler=sched)
