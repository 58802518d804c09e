"""trainer/distributed/deepspeed.py without a process group: config filling, backward/step, wrappers, no-op paths.

The helpers' distributed behaviour (ZeRO-2/3 on 2 CPU processes) is checked by the slow
tests of test_distributed_configs.py; these pin the single-process logic and the
``trainer.models.policy.completion_hidden`` dispatch.
"""
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from trainer.distributed import deepspeed as D
from trainer.models import policy_forward as PF
from trainer.models.batch import build_token_batch


def _accelerator(stage=None, *, num_processes=1, zero3_init_flag=False, **ds):
    """A stand-in with what the helpers read: distributed_type, state.deepspeed_plugin, num_processes,
    unwrap_model (accelerate's strips the DDP / DeepSpeed engine, i.e. ``.module``)."""
    if stage is None:
        return SimpleNamespace(distributed_type=DistributedType.NO, num_processes=num_processes, state=None,
                               unwrap_model=lambda m: m.module if hasattr(m, "module") else m)
    weakrefs = []
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}, **ds},
                             zero3_init_flag=zero3_init_flag, set_deepspeed_weakref=lambda: weakrefs.append(1))
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=num_processes,
                           state=SimpleNamespace(deepspeed_plugin=plugin), weakrefs=weakrefs,
                           unwrap_model=lambda m: m.module if hasattr(m, "module") else m)


def test_deepspeed_stage():
    assert D.deepspeed_stage(_accelerator()) == 0
    assert D.deepspeed_stage(_accelerator(2)) == 2
    assert D.deepspeed_stage(_accelerator(3)) == 3
    for stage in (0, 1):
        with pytest.raises(NotImplementedError, match="stage 2 or 3"):
            D.deepspeed_stage(_accelerator(stage))


def test_fill_deepspeed_config_takes_the_recipe_values():
    acc = _accelerator(2, gradient_clipping="auto", gradient_accumulation_steps="auto",
                       train_micro_batch_size_per_gpu="auto", bf16={"enabled": False})
    cfg = D.fill_deepspeed_config(acc, micro_batch_size=4, max_grad_norm=0.5)
    assert cfg is acc.state.deepspeed_plugin.deepspeed_config  # filled in place, before prepare reads it
    assert (cfg["gradient_clipping"], cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]) == (0.5, 1, 4)
    assert cfg["managed_gradient_accumulation"] is False
    absent = _accelerator(3)  # no key at all would mean: DeepSpeed does not clip
    assert D.fill_deepspeed_config(absent, micro_batch_size=2, max_grad_norm=1.0)["gradient_clipping"] == 1.0
    same = _accelerator(2, gradient_clipping=0.5, gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=8)
    assert D.fill_deepspeed_config(same, micro_batch_size=4, max_grad_norm=0.5)["train_micro_batch_size_per_gpu"] == 8
    assert D.fill_deepspeed_config(_accelerator(), micro_batch_size=4, max_grad_norm=0.5) == {}


@pytest.mark.parametrize("bad, match", [
    ({"gradient_clipping": 1.0}, "max_grad_norm"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
    ({"bf16": {"enabled": True}}, "bf16.enabled"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled"),
    ({"managed_gradient_accumulation": True}, "managed_gradient_accumulation"),
])
def test_fill_deepspeed_config_refuses_what_would_change_the_training(bad, match):
    with pytest.raises(ValueError, match=match):
        D.fill_deepspeed_config(_accelerator(3, **bad), micro_batch_size=4, max_grad_norm=0.5)


class _Calls:
    """Records the calls the step helpers make, in order (stands in for accelerator, engine, optimizer)."""

    def __init__(self, norm=3.0):
        self.log, self.norm = [], norm

    def backward(self, loss):
        self.log.append(("backward", float(loss)))

    def step(self):
        self.log.append(("step",))

    def zero_grad(self, set_to_none=None):
        self.log.append(("zero_grad", set_to_none))

    def clip_grad_norm_(self, params, max_norm):
        self.log.append(("clip", max_norm))
        return torch.tensor(self.norm)

    def get_global_grad_norm(self):
        self.log.append(("norm",))
        return torch.tensor(self.norm)


def test_without_deepspeed_the_loop_steps_as_today():
    acc, calls = _accelerator(), _Calls()
    acc.backward, acc.clip_grad_norm_ = calls.backward, calls.clip_grad_norm_
    assert D.make_backward(acc, model=None) is acc.backward
    assert D.optimizer_step(acc, torch.nn.Linear(2, 2), calls, [], 0.5) == 3.0
    assert calls.log == [("clip", 0.5), ("step",), ("zero_grad", True)]


def test_under_deepspeed_backward_sums_over_ranks_and_the_engine_steps_once():
    acc, engine, optimizer = _accelerator(3, num_processes=4), _Calls(norm=2.5), _Calls()
    acc.backward = acc.clip_grad_norm_ = None  # neither may be used under DeepSpeed
    backward = D.make_backward(acc, engine)
    backward(torch.tensor(1.0))
    backward(torch.tensor(0.5))
    # DeepSpeed averages over the 4 ranks; the loop's losses are normalised by the global batch.
    assert engine.log == [("backward", 4.0), ("backward", 2.0)]
    assert D.optimizer_step(acc, engine, optimizer, [], 0.5) == 2.5
    assert engine.log[2:] == [("step",), ("norm",)] and optimizer.log == []  # the wrapper's step is not the update


def test_accelerator_kwargs(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU-host behaviour")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert D.accelerator_kwargs() == {"cpu": True}
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    kw = D.accelerator_kwargs()
    assert kw["cpu"] is False and [h.backend for h in kw["kwargs_handlers"]] == ["gloo"]


def test_accelerator_kwargs_on_a_cuda_host_ask_for_a_group_with_a_cpu_backend(monkeypatch):
    """A launched rank on CUDA, with or without DeepSpeed: NCCL for CUDA tensors, gloo for the loop's CPU ones
    (trainer/distributed/process_group.py); one process: accelerate's defaults (it makes no group then)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert D.accelerator_kwargs() == {}
    monkeypatch.setenv("LOCAL_RANK", "1")
    for deepspeed in ("false", "true"):
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", deepspeed)
        kw = D.accelerator_kwargs()
        assert [h.to_kwargs()["backend"] for h in kw["kwargs_handlers"]] == ["cuda:nccl,cpu:gloo"] and "cpu" not in kw


def test_model_load_context_turns_transformers_zero_init_off_for_zero3_only():
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    ds = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    keep = HfDeepSpeedConfig(ds)  # noqa: F841  (what accelerate registers; transformers holds a weakref)
    try:
        assert is_deepspeed_zero3_enabled()
        acc = _accelerator(3)
        acc.state.deepspeed_plugin.set_deepspeed_weakref = lambda: acc.weakrefs.append(HfDeepSpeedConfig(ds))
        with D.model_load_context(acc):
            assert not is_deepspeed_zero3_enabled()  # from_pretrained would not use deepspeed.zero.Init here
        assert len(acc.weakrefs) == 1 and is_deepspeed_zero3_enabled()  # accelerate's registration put back
        with D.model_load_context(_accelerator(2)):
            assert is_deepspeed_zero3_enabled()  # untouched outside ZeRO-3
        with pytest.raises(NotImplementedError, match="zero3_init_flag"):
            with D.model_load_context(_accelerator(3, zero3_init_flag=True)):
                pass
    finally:
        unset_hf_deepspeed_config()


def test_gather_helpers_are_no_ops_without_zero3():
    lin = torch.nn.Linear(3, 2)
    assert D.full_lm_head(lin) is lin
    assert not D.is_zero3_partitioned(lin)
    with D.zero3_gather(lin)(list(lin.parameters())), D.gathered_trainable(lin):
        pass


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from trainer.config import LoraConfig
    from trainer.models.policy import add_lora, load_base_model

    torch.manual_seed(0)
    model = add_lora(load_base_model(tiny_model_dir, "bfloat16"), LoraConfig())
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)  # lora_B non-zero: the adapter changes the output
    return model


class _Wrapped(torch.nn.Module):
    """What a DeepSpeed engine looks like to completion_hidden: ``.module`` and a forward calling it."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kw):
        return self.module(**kw)


def test_completion_hidden_through_policy_forward_is_the_direct_computation(policy):
    from trainer.models.policy import completion_hidden, completion_logprobs

    batch = build_token_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], pad_id=0)
    wrapped = _Wrapped(PF.PolicyForward(policy))
    assert PF.wrapped_policy_forward(wrapped) is wrapped.module and PF.wrapped_policy_forward(policy) is None
    with torch.no_grad():
        h_direct, head_direct, no_values = completion_hidden(policy, batch)
        h_wrapped, head_wrapped, _ = completion_hidden(wrapped, batch)
        lp_direct, _ = completion_logprobs(policy, batch, temperature=1.0)
        lp_wrapped, _ = completion_logprobs(wrapped, batch, temperature=1.0)
        with wrapped.module.disable_adapter():  # what the loop calls on the prepared model
            lp_base, _ = completion_logprobs(wrapped, batch, temperature=1.0)
    assert torch.equal(h_direct, h_wrapped) and no_values is None
    # The same lm_head weight and the same logit transform (a LogitHead is built per call).
    assert head_direct.weight is head_wrapped.weight and head_direct.transform == head_wrapped.transform
    assert torch.equal(lp_direct, lp_wrapped)
    assert not torch.equal(lp_base, lp_wrapped)  # the adapter really was disabled
    assert wrapped.module.config is policy.config


def test_value_head_inside_policy_forward_gives_the_direct_values_and_gradients(policy):
    """PPO under DeepSpeed: the engine's forward computes the values; same values and gradients as outside."""
    from trainer.models.policy import completion_hidden
    from trainer.rl.value_head import ValueHead

    batch = build_token_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], pad_id=0)
    head = ValueHead(policy.config.hidden_size)
    torch.nn.init.normal_(head.linear.weight, std=0.1)  # zero-initialised heads would hide a wrong position
    wrapped = _Wrapped(PF.PolicyForward(policy, head))
    grads = []
    for model in (policy, wrapped):
        head.zero_grad(set_to_none=True)
        hidden, _, values = completion_hidden(model, batch, head)
        assert values.shape == batch.targets.shape
        (values * batch.mask).sum().backward()
        grads.append((values.detach(), head.linear.weight.grad.clone()))
    # position t of the values is the head on the hidden state that predicts completion token t
    with torch.no_grad():
        assert torch.allclose(grads[0][0], head(completion_hidden(policy, batch)[0]))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    with pytest.raises(ValueError, match="not the one inside the DeepSpeed engine"):
        completion_hidden(wrapped, batch, ValueHead(policy.config.hidden_size))
    with torch.no_grad():  # the reference forward (adapter off) through the engine ignores the values
        _, _, none = completion_hidden(wrapped, batch)
    assert none is None


def test_wrap_and_unwrap(policy):
    for plain in (_accelerator(), _accelerator(num_processes=2)):  # data parallel without DeepSpeed: not prepared
        assert PF.wrap_for_prepare(plain, policy) is policy
        assert PF.unwrap_policy(plain, policy) is policy
    for acc in (_accelerator(2), _accelerator(3, num_processes=2)):
        wrapper = PF.wrap_for_prepare(acc, policy)
        assert isinstance(wrapper, PF.PolicyForward) and wrapper.policy is policy and wrapper.value_head is None
        assert PF.unwrap_policy(acc, _Wrapped(wrapper)) is policy
        head = torch.nn.Linear(2, 1)
        assert PF.wrap_for_prepare(acc, policy, head).value_head is head  # PPO: the engine owns the critic
