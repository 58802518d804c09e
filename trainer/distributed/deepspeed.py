"""DeepSpeed ZeRO-2 / ZeRO-3 helpers for the training loop, through accelerate's DeepSpeed plugin.

What they handle, and the sources they rely on (DeepSpeed 0.19.8, accelerate 1.15.0,
read in the installed packages):

- ``deepspeed_stage``: which ZeRO stage the accelerator runs (0 = no DeepSpeed).
- ``accelerator_kwargs``: on a CPU-only host ``Accelerator(cpu=True)`` never enables
  DeepSpeed (``accelerate/state.py``: the DeepSpeed branch is ``... and not cpu``), and
  with ``cpu=False`` accelerate finds no backend for CPU and would treat a 2-rank
  launch as one process; passing ``backend="gloo"`` fixes both. On a CUDA host a launched rank asks for
  ``cuda:nccl,cpu:gloo`` (``trainer.distributed.process_group``), which accelerate hands to DeepSpeed's
  ``init_distributed`` as well.
- ``fill_deepspeed_config``: the values of the DeepSpeed config that depend on the
  recipe. accelerate fills ``gradient_clipping: "auto"`` with a hard-coded 1.0
  (``Accelerator._prepare_deepspeed``), not with ``train.max_grad_norm``, and under
  DeepSpeed ``accelerator.clip_grad_norm_`` does NOT clip: it only reports the norm of
  the engine's last ``step()``, which clips at the config's value. So the config must
  hold the recipe's value before ``prepare``.
- ``model_load_context``: under ZeRO-3, load the model without transformers'
  ``deepspeed.zero.Init`` (which would change its dtypes; see there).
- ``make_backward`` / ``optimizer_step``: the loop's backward-per-micro-batch, then
  clip + step + zero_grad, under DeepSpeed. accelerate's DeepSpeed ``backward`` would
  run the engine's whole ``step()`` (clip, update, zero_grad) inside the backward of
  every micro-batch while ``sync_gradients`` is true (``accelerate/utils/deepspeed.py``,
  ``DeepSpeedEngineWrapper.backward``): before the loop's parity limits are checked.
  Instead DeepSpeed runs with ``managed_gradient_accumulation: false`` (its backward
  only accumulates; ``engine.step()`` is the boundary that reduces/finalizes, clips
  and updates: ``DeepSpeedEngine.step`` docstring), called where the loop steps.
- ``deepspeed_stage`` also tells ``trainer.models.policy_forward.wrap_for_prepare`` to route the
  policy's backbone call through ``DeepSpeedEngine.forward`` (see ``PolicyForward`` there for why).
- ``full_lm_head``: ``trainer.models.policy`` feeds ``lm_head.weight`` straight to the fused
  log-prob kernel without calling ``lm_head``; under ZeRO-3 that tensor is a
  partition placeholder of shape (0,) outside the module's own forward (observed:
  ``ValueError: weight: expected a [V, H] tensor, got shape (0,)``). The backbone's
  weights are gathered: ZeRO-3 registers its fetch/release hooks on every submodule
  (``deepspeed/runtime/zero/parameter_offload.py``, ``_register_deepspeed_module``),
  and the backbone's modules are called; lm_head never is.
- ``zero3_gather``: the ``gather`` of ``rollout.weight_export.iter_merged_lora_weights``,
  one module's parameters at a time (``deepspeed.zero.GatheredParameters``,
  https://deepspeed.readthedocs.io/en/latest/zero3.html#deepspeed.zero.GatheredParameters).
- ``gathered_trainable``: the adapter weights, whole, for a PEFT ``save_pretrained``
  under ZeRO-3 (otherwise it would save the empty placeholders).

deepspeed is imported only inside the functions that need a ZeRO-3 model, so this
module imports without the ``deepspeed`` extra.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, ContextManager, Sequence

import torch
from torch import nn

from trainer.distributed.gradient_guard import nonfinite_gradients, skipped_update_message
from trainer.distributed.process_group import launch_backend

Gather = Callable[[Sequence[nn.Parameter]], ContextManager]


def deepspeed_stage(accelerator) -> int:
    """0 without DeepSpeed, else the ZeRO stage of its config (2 or 3; others are refused)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return 0
    stage = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
    if stage not in (2, 3):
        raise NotImplementedError(
            f"DeepSpeed zero_optimization.stage={stage!r}: parityrl supports ZeRO stage 2 or 3 only "
            "(recipes/accelerate/zero2.yaml, zero3.yaml); stages 0 and 1 were never run here")
    return stage


def deepspeed_requested() -> bool:
    """Whether DeepSpeed is asked for: what ``accelerate launch`` sets from a DeepSpeed config
    (``accelerate/utils/launch.py``), or set by hand under ``torchrun``."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator_kwargs() -> dict:
    """Keyword arguments for ``Accelerator(...)``: the process group's backend, and DeepSpeed on CPU-only hosts too.

    A launched rank on a CUDA host asks for ``trainer.distributed.process_group.CUDA_BACKEND`` (NCCL for CUDA
    tensors, gloo for the loop's CPU ones; why there), with or without DeepSpeed; one process on a GPU host gets
    accelerate's defaults; a CPU host ``cpu=True``. DeepSpeed is requested through the environment that
    ``accelerate launch`` sets from the config file (``ACCELERATE_USE_DEEPSPEED=true``), or by hand under ``torchrun``.
    """
    from accelerate.utils import InitProcessGroupKwargs

    use_deepspeed = deepspeed_requested()
    if torch.cuda.is_available():
        backend = launch_backend()
        return {} if backend is None else {"kwargs_handlers": [InitProcessGroupKwargs(backend=backend)]}
    if not use_deepspeed:
        return {"cpu": True}
    # cpu=False: the only way into accelerate's DeepSpeed branch. backend="gloo": without it
    # accelerate's _prepare_backend returns no backend on a CPU host and reports 1 process.
    return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}


def fill_deepspeed_config(accelerator, *, micro_batch_size: int, max_grad_norm: float) -> dict:
    """Put the recipe's values into the DeepSpeed config before ``accelerator.prepare``; return it.

    - ``gradient_clipping``: ``"auto"`` or absent -> ``max_grad_norm`` (DeepSpeed clips in
      ``engine.step()``, with the same ``max_norm / (norm + 1e-6)`` factor as
      ``torch.nn.utils.clip_grad_norm_``); any other number must equal it.
    - ``gradient_accumulation_steps`` must be 1 (``"auto"`` -> 1): DeepSpeed divides every
      loss by it (``engine.backward``, ``scale_wrt_gas``), while the loop's losses are
      already normalised by the whole batch.
    - ``managed_gradient_accumulation`` must be false (absent -> false): the loop owns the
      accumulation boundary, ``optimizer_step`` (module docstring).
    - ``train_micro_batch_size_per_gpu``: ``"auto"`` -> ``micro_batch_size``. The loop feeds
      DeepSpeed no DataLoader, so accelerate cannot infer it; DeepSpeed only uses it for
      its batch-size bookkeeping here.
    - ``bf16.enabled`` / ``fp16.enabled`` must be false: DeepSpeed would cast every
      parameter, the float32 LoRA adapters included, to 16 bits
      (``DeepSpeedEngine._cast_module_mixed_precision``), which changes the trainer's
      log-probs; the base weights' dtype is the recipe's ``model.dtype`` already.
    No-op (returns ``{}``) without DeepSpeed.
    """
    if deepspeed_stage(accelerator) == 0:
        return {}
    cfg = accelerator.state.deepspeed_plugin.deepspeed_config
    clip = cfg.get("gradient_clipping", "auto")
    if clip == "auto":
        cfg["gradient_clipping"] = float(max_grad_norm)
    elif float(clip) != float(max_grad_norm):
        raise ValueError(f"DeepSpeed config gradient_clipping={clip} but the recipe's train.max_grad_norm="
                         f"{max_grad_norm}; DeepSpeed does the clipping, so set it to \"auto\" (filled from the recipe)")
    gas = cfg.get("gradient_accumulation_steps", "auto")
    if gas == "auto":
        cfg["gradient_accumulation_steps"] = 1
    elif int(gas) != 1:
        raise ValueError(f"DeepSpeed config gradient_accumulation_steps={gas}: must be 1 or \"auto\"; the loop "
                         "accumulates micro-batches itself and its losses are already normalised by the whole batch")
    if cfg.setdefault("managed_gradient_accumulation", False) is not False:
        raise ValueError("DeepSpeed config managed_gradient_accumulation must be false: the loop calls engine.step() "
                         "itself once per optimizer step (trainer.distributed.deepspeed.optimizer_step)")
    if cfg.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        cfg["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    for half in ("bf16", "fp16"):
        if str(cfg.get(half, {}).get("enabled", False)).lower() == "true":
            raise ValueError(f"DeepSpeed config {half}.enabled is true: DeepSpeed would cast the float32 LoRA adapters "
                             f"to {half}; set it to false (and mixed_precision: 'no' in the accelerate config), the "
                             "base weights already have the recipe's model.dtype")
    return cfg


@contextlib.contextmanager
def model_load_context(accelerator):
    """Wrap the model load (``load_base_model`` + ``add_lora``): under ZeRO-3, without transformers' zero.Init.

    With a ZeRO-3 plugin selected, accelerate 1.15 registers the DeepSpeed config with
    transformers whatever ``zero3_init_flag`` says (``DeepSpeedPlugin.set_deepspeed_weakref``),
    so ``from_pretrained`` builds the model inside ``deepspeed.zero.Init`` with
    DeepSpeed's dtype: float32 with bf16 off (observed: every parameter float32, the
    trainer's log-probs 4.5e-2 away from the bf16 model's), bf16 with bf16 on (the LoRA
    adapters too, once DeepSpeed casts). Loading outside it keeps the recipe's
    ``model.dtype`` for the base and float32 for the adapters (observed: log-probs and
    export bit-identical to the single-process model); ``deepspeed.initialize`` then
    partitions the loaded model. The cost: each rank first holds the whole model (and
    DeepSpeed moves it whole to the device before partitioning,
    ``DeepSpeedEngine._configure_distributed_model``), so the base model must fit one
    device. ``zero3_init_flag: true`` is refused for that dtype change.
    """
    if deepspeed_stage(accelerator) != 3:
        yield
        return
    plugin = accelerator.state.deepspeed_plugin
    if plugin.zero3_init_flag:
        raise NotImplementedError(
            "ZeRO-3 with zero3_init_flag true: transformers would build the model inside deepspeed.zero.Init in "
            "DeepSpeed's dtype (float32 with bf16 off), not the recipe's model.dtype; set zero3_init_flag: false "
            "(recipes/accelerate/zero3.yaml; under torchrun ACCELERATE_DEEPSPEED_ZERO3_INIT=false)")
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # what accelerate had registered (other transformers code may read it)


def make_backward(accelerator, model) -> Callable[[torch.Tensor], None]:
    """The loop's ``backward(loss)``, called once per micro-batch (no optimizer step in it).

    Without DeepSpeed: ``accelerator.backward``. Under DeepSpeed: ``engine.backward`` of the
    prepared ``model`` (with ``managed_gradient_accumulation: false`` it accumulates,
    ZeRO-2/3 reducing each micro-batch's gradient into the partitions), on ``loss`` times
    the number of processes: DeepSpeed AVERAGES gradients over the ranks, while the loop
    normalises every rank's loss by the whole (all ranks') batch, so the ranks' gradients
    must SUM to the batch gradient (checked: ``bench/checks/zero_cpu_check.py``).
    ``accelerator.backward`` cannot be used there: it calls
    ``engine.set_gradient_accumulation_boundary``, which DeepSpeed refuses in that mode.
    """
    if not deepspeed_stage(accelerator):
        return accelerator.backward
    world = float(accelerator.num_processes)

    def backward(loss: torch.Tensor) -> None:
        model.backward(loss * world)

    return backward


def optimizer_step(accelerator, model, optimizer, params, max_grad_norm: float) -> float:
    """Clip, step and zero the gradients once the micro-batches' backwards are done; return the grad norm.

    Without DeepSpeed: ``accelerator.clip_grad_norm_`` (the pre-clip total norm), ``step``,
    ``zero_grad(set_to_none=True)``; where a gradient is not finite, no ``step`` (trainer/distributed/gradient_guard.py)
    and a norm that is NaN or inf. Under DeepSpeed:
    ``engine.step()`` finalizes the accumulated (reduced) gradients, clips them at the
    config's ``gradient_clipping`` (= ``max_grad_norm``, ``fill_deepspeed_config``), updates
    and zeroes; its ``get_global_grad_norm()`` is the pre-clip norm, as torch's.
    ``accelerator.clip_grad_norm_`` would only return the PREVIOUS step's norm there.
    """
    if deepspeed_stage(accelerator):
        model.step()
        norm = model.get_global_grad_norm()
        norm = float(norm.item() if hasattr(norm, "item") else norm)
        if not math.isfinite(norm) and accelerator.is_main_process:
            print(f"warning: the gradient norm is {norm} and DeepSpeed's engine has stepped with it (it steps "
                  "inside engine.step(), before the norm can be read)", flush=True)
        return norm
    bad = nonfinite_gradients(p for p in accelerator.unwrap_model(model).named_parameters() if p[1].requires_grad)
    norm = float(accelerator.clip_grad_norm_(params, max_grad_norm))
    if bad or not math.isfinite(norm):  # trainer/distributed/gradient_guard.py: the weights stay as they were
        if accelerator.is_main_process:  # a parameter outside the policy module (PPO's value head) has no name here
            print(skipped_update_message(bad or ["a parameter outside the policy module"], norm), flush=True)
        norm = norm if not math.isfinite(norm) else math.nan
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def is_zero3_partitioned(model: nn.Module) -> bool:
    """True when ZeRO-3 has partitioned ``model``'s parameters (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def zero3_gather(model: nn.Module) -> Gather:
    """The ``gather`` for ``iter_merged_lora_weights``: one module's parameters, gathered while it is exported.

    ``rollout.weight_export`` calls ``gather(list(module.parameters()))`` for one exported
    module at a time (a LoRA layer: its base weight and adapters) and reads them inside
    the context. ``modifier_rank=None``: every rank gathers (it is a collective: all ranks
    must run the export) and nothing is written back; the parameters are re-partitioned
    on exit, so at most one module is whole at any time. Not under ZeRO-3: no-op.
    """
    if not is_zero3_partitioned(model):
        return lambda params: contextlib.nullcontext()
    import deepspeed

    def gather(params: Sequence[nn.Parameter]) -> ContextManager:
        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)

    return gather


class _FrozenLinear:
    """The gathered, detached ``weight`` / ``bias`` of a frozen Linear (what ``logprobs_from_hidden`` reads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias


def full_lm_head(lm_head: nn.Module):
    """``lm_head`` itself, or under ZeRO-3 an object holding its full weight/bias (gathered copies).

    The policy uses ``lm_head.weight`` directly (fused log-prob kernel) instead of calling
    the module, so ZeRO-3's per-module hooks never gather it. A detached copy made inside
    ``GatheredParameters`` stays valid through the backward (which needs the weight to
    compute d hidden); it costs one [V, H] tensor until the backward ends, as ZeRO-3's own
    gather of a called lm_head would. Only a frozen lm_head is supported: the copy
    carries no gradient.
    """
    params = list(lm_head.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return lm_head
    if any(p.requires_grad for p in params):
        raise NotImplementedError("ZeRO-3 with a trainable lm_head: the fused log-prob path reads lm_head.weight "
                                  "directly and cannot route its gradient through ZeRO-3; keep lm_head frozen "
                                  "(not in model.lora.target_modules)")
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        weight = lm_head.weight.detach().clone()
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach().clone()
    return _FrozenLinear(weight, bias)


def gathered_trainable(model: nn.Module) -> ContextManager:
    """Context in which the trainable (adapter) parameters are whole on every rank (ZeRO-3), else no-op.

    For ``save_pretrained`` of the adapter: call on every rank (collective), write on the
    main process inside it. Adapters are small, so they are gathered together.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
