"""The architecture matrix, fast tier: trainer log-probs == the model's own forward; refusals up front.

Models: ``trainer.builtin.zoo`` (random init at std 0.2, non-zero biases, 2 layers, hidden 64),
built once per cache. The engine side (vLLM) is in tests/rollout/test_architectures_engine.py.
"""
import pytest
import torch

from trainer.builtin.zoo import ARCHITECTURES, ensure_arch_model
from trainer.config import LoraConfig
from trainer.models.architecture import (
    attention_implementation,
    decoder_linear_leaves,
    frozen_expert_params,
    logit_transform,
    resolve_lora_targets,
)
from trainer.models.batch import build_token_batch
from trainer.models.policy import add_lora, completion_logprobs, load_base_model

ARCHS = sorted(ARCHITECTURES)
# Deterministic prompts/completions over the zoo's 512-token vocabulary (ragged on purpose: padding).
PROMPTS = [[1, 3, 40, 77, 301, 4], [1, 3, 9, 500, 4]]
COMPLETIONS = [[17, 250, 33, 2], [450, 6, 88, 123, 71, 2]]


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request):
    return request.param, str(ensure_arch_model(request.param))


def own_forward_logprobs(model, batch, temperature):
    """log_softmax(model(...).logits.float() / T) at the completion tokens: the reference the trainer must equal."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    p, c = batch.prompt_len, batch.targets.shape[1]
    lp = torch.log_softmax(logits[:, p - 1:p - 1 + c] / temperature, dim=-1)
    safe = batch.targets.clamp_min(0)
    return lp.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * batch.mask


def test_trainer_logprobs_equal_the_models_own_forward(arch_dir):
    arch, path = arch_dir
    model = load_base_model(path, "float32").eval()
    batch = build_token_batch(PROMPTS, COMPLETIONS, pad_id=0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=0.7)
    ref = own_forward_logprobs(model, batch, 0.7)
    assert (lp * batch.mask - ref).abs().max() < 2e-5, arch
    # Far from uniform (log 512 = 6.24): a dropped transform or bias would not hide in the noise.
    assert ref[batch.mask > 0].std() > 0.5


def test_gemma2_transform_and_attention_are_the_models():
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(str(ensure_arch_model("gemma2")))
    assert logit_transform(conf) == {"logit_softcap": 30.0, "logit_scale": 1.0}
    assert attention_implementation(conf) == "eager"
    model = load_base_model(str(ensure_arch_model("gemma2")), "float32")
    assert model.config._attn_implementation == "eager"
    # Without the softcap the kernel is visibly off the model's forward (the bug this fixes).
    from parity.logprobs import fused_logprobs
    from trainer.models.architecture import split_model

    batch = build_token_batch(PROMPTS, COMPLETIONS, pad_id=0)
    backbone, head = split_model(model)
    with torch.no_grad():
        h = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=batch.position_ids).last_hidden_state[:, batch.prompt_len - 1:]
        h = h[:, :batch.targets.shape[1]]
        plain, _ = fused_logprobs(h, head.weight, batch.targets)
    assert (plain * batch.mask - own_forward_logprobs(model, batch, 1.0)).abs().max() > 1e-2


def test_cohere_and_granite_scales():
    from transformers import CohereConfig, GraniteConfig

    assert logit_transform(CohereConfig(logit_scale=0.125)) == {"logit_softcap": None, "logit_scale": 0.125}
    assert logit_transform(GraniteConfig(logits_scaling=8.0)) == {"logit_softcap": None, "logit_scale": 0.125}
    assert attention_implementation(CohereConfig()) is None


def test_sdpa_gemma2_would_drop_the_attention_softcap():
    # Why load_base_model picks eager: the same weights under SDPA compute another function.
    from transformers import AutoModelForCausalLM

    path = str(ensure_arch_model("gemma2"))
    ids = torch.tensor([PROMPTS[0] + COMPLETIONS[0]])
    outs = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=a)(ids).logits
            for a in ("eager", "sdpa")]
    assert (outs[0] - outs[1]).abs().max() > 1e-3


EXPECTED_LEAVES = {
    "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
    "qwen2_moe": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    "llama_tied": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
}


@pytest.mark.parametrize("arch", sorted(EXPECTED_LEAVES))
def test_default_lora_targets_are_discovered(arch, capsys):
    from trainer.builtin.zoo import build_arch_model

    model, _ = build_arch_model(arch)
    assert decoder_linear_leaves(model) == EXPECTED_LEAVES[arch]
    peft_model = add_lora(model, LoraConfig())
    out = capsys.readouterr().out
    assert "LoRA targets" in out and ", ".join(EXPECTED_LEAVES[arch]) in out
    wrapped = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(EXPECTED_LEAVES[arch])
    if arch == "qwen2_moe":
        # Routed experts are fused 3-D tensors no target_modules entry reaches: frozen, and said so.
        assert frozen_expert_params(model) == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                               for p in ("gate_up_proj", "down_proj")]
        assert "fused MoE expert tensors stay frozen" in out
        assert not any(p.requires_grad for n, p in peft_model.named_parameters() if "experts" in n)


def test_explicit_targets_still_work_and_unknown_names_are_refused():
    from trainer.builtin.zoo import build_arch_model

    model, _ = build_arch_model("phi3")
    assert resolve_lora_targets(model, ["qkv_proj"]) == ["qkv_proj"]
    with pytest.raises(ValueError, match=r"\['q_proj'\] not found.*qkv_proj"):
        resolve_lora_targets(model, ["q_proj", "o_proj"])
    with pytest.raises(ValueError, match="only entry"):
        resolve_lora_targets(model, ["all-linear", "o_proj"])


def test_lora_on_tied_embeddings_is_refused():
    from trainer.builtin.zoo import build_arch_model

    model, _ = build_arch_model("llama_tied")
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        resolve_lora_targets(model, ["q_proj", "embed_tokens"])
    untied, _ = build_arch_model("qwen2")
    assert resolve_lora_targets(untied, ["embed_tokens"]) == ["embed_tokens"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unknown_logit_postprocessing_is_refused(dtype, monkeypatch):
    # An architecture whose forward transforms the logits in a way logit_transform does not know
    # (simulated: the known transform is hidden from the kernel) is refused at load.
    import trainer.models.architecture as arch_mod
    import trainer.models.policy as policy

    monkeypatch.setattr(arch_mod, "logit_transform", lambda config: {"logit_softcap": None, "logit_scale": 1.0})
    with pytest.raises(ValueError, match="logit post-processing is not supported"):
        policy.load_base_model(str(ensure_arch_model("gemma2", dtype=dtype)), dtype)
    monkeypatch.undo()
    policy.load_base_model(str(ensure_arch_model("gemma2", dtype=dtype)), dtype)  # the known transform passes


# ---- fp8_unified: the trainer's quantized set is the engine's --------------------------------------
def _engine_fp8_hf_names(model, vllm_arch: str) -> set[str]:
    """HF names of the Linear layers the engine's FP8 method quantizes, by its own rule on its own layer names.

    vLLM names a fused layer by its packed name (qkv_proj for q/k/v); ``EmulatedFp8Config.is_target``
    decides per vLLM prefix from the model class's ``packed_modules_mapping`` (what vLLM's loader
    hands the quant config, vllm/model_executor/model_loader/utils.py).
    """
    from torch import nn
    from vllm.model_executor.models import ModelRegistry

    from rollout.vllm_plugins.fp8_quant import EmulatedFp8Config

    cls = ModelRegistry._try_load_model_cls(vllm_arch)
    packed = dict(getattr(cls, "packed_modules_mapping", {}))
    if vllm_arch == "Qwen2MoeForCausalLM":
        packed["gate_up_proj"] = ["gate_proj", "up_proj"]  # added in Qwen2MoeForCausalLM.__init__ (shared expert)
    shard_to_fused = {s: fused for fused, shards in packed.items() for s in shards}
    quant = EmulatedFp8Config()
    quant.packed_modules_mapping = packed
    names = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            leaf = name.rsplit(".", 1)[-1]
            if quant.is_target(name.rsplit(".", 1)[0] + "." + shard_to_fused.get(leaf, leaf)):
                names.add(name)
    return names


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "phi3"])
def test_fp8_module_sets_of_trainer_and_engine_are_the_same(arch):
    from trainer.builtin.zoo import build_arch_model
    from trainer.models.precision import convert_to_fp8

    model, _ = build_arch_model(arch)
    engine_side = _engine_fp8_hf_names(model, type(model).__name__)
    trainer_side = set(convert_to_fp8(model))
    assert trainer_side == engine_side
    assert len(trainer_side) >= 2 * 7  # both layers, all seven projections (MoE: the shared expert's)


def test_fp8_on_fused_hf_modules_is_refused():
    from trainer.builtin.zoo import build_arch_model
    from trainer.precision.registry import recipe_for

    model, _ = build_arch_model("phi3")
    with pytest.raises(ValueError, match=r"fp8_unified.*\['gate_up_proj', 'qkv_proj'\].*block grids"):
        recipe_for("fp8_unified").transform(model)


# ---- slow: the real vLLM engine per architecture ----------------------------------------------------
# vLLM float32 vs the trainer in float32: the same function computed by different kernels.
ENGINE_MAE_BOUND = 1e-4
SYNC_ARCHS = ("qwen2", "gemma2")  # the LoRA-sync check costs a second engine start per architecture


@pytest.mark.slow
def test_engine_vs_trainer_float32_and_lora_sync_per_architecture(tmp_path):
    """bench/parity/arch_parity.py in a subprocess: one engine per architecture, one after another.

    A subprocess because the session already holds a vLLM engine (tests/conftest.py), and a second
    engine in one process breaks the first (tests/rollout/test_fp8_quant.py).
    """
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(repo / "bench" / "parity" / "arch_parity.py"), "--dtypes", "float32", "--prompts", "2",
           "--tokens", "8", "--sync-check", ",".join(SYNC_ARCHS), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    rows = {r["arch"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ARCHS
    for r in rows.values():
        assert r["engine_vs_trainer"] < ENGINE_MAE_BOUND, r
        assert r["trainer_vs_own"] < 2e-5, r
        # Samples that carry information: not all near-certain tokens.
        assert r["mean_logprob"] < -0.05, r
    for arch in SYNC_ARCHS:
        r = rows[arch]
        assert r["sync_changed"] and r["sync_same_samples"] and r["sync_same_logprobs"], r


@pytest.mark.slow
@pytest.mark.parametrize("overrides, match", [
    (["precision.recipe=fp8_unified"], "fp8_unified.*qkv_proj"),
    (["model.lora.target_modules=[q_proj,v_proj]"], r"'q_proj' matches no module.*'v_proj' matches no module"),
])
def test_unsupported_combination_is_refused_at_start_by_the_cli(tmp_path, overrides, match):
    # Phi3 (fused qkv_proj): exit 2 with one line naming the key, before any engine starts.
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    sets = [a for o in [f"model.path={ensure_arch_model('phi3')}", f"name={tmp_path.name}", *overrides]
            for a in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", str(repo / "recipes" / "grpo_tiny.yaml"), *sets,
                           "--set", f"logging.run_dir={tmp_path}/runs/{{name}}", "--set", "logging.wandb.mode=disabled"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True,
                          timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("parityrl:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and re.search(match, errors[0]), proc.stderr[-2000:]
    assert "Initializing a V1 LLM engine" not in proc.stderr


def test_hf_engine_loads_gemma2_with_the_attention_softcap():
    from rollout.hf_engine import HFEngine

    engine = HFEngine(str(ensure_arch_model("gemma2")), dtype="float32")
    assert engine.model.config._attn_implementation == "eager"
