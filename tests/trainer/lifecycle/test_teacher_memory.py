"""A colocated teacher's engine options on CUDA and its memory in the capacity check
(trainer/lifecycle/teacher_memory.py), without a GPU: vLLM's own config classes judge the options
(``SchedulerConfig``'s batch rule, ``CacheConfig``'s share, ``FullAttentionSpec``'s KV page), the capacity check
is fed the sizes of a 7B model, and the teacher's engine start records what it would hand vLLM.
"""
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from vllm.config import CacheConfig, SchedulerConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec

import trainer.teacher.teacher as teacher_module
from rollout.vllm_engine import DEFAULT_CPU_KV_CACHE_BYTES
from trainer.config import RecipeError
from trainer.config.validate import sequence_length
from trainer.lifecycle.capacity import Machine, ModelSize, capacity_problems
from trainer.lifecycle.preflight import check_capacity, load_recipe
from trainer.lifecycle.teacher_memory import (
    TEACHER_BATCH_TOKENS,
    model_size,
    teacher_engine_options,
    teacher_memory,
    teacher_parity_measured,
)

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"
GiB = 1024**3
# Qwen2.5-7B's config.json (the sizes the KV cache depends on) and its parameter count (safetensors headers)
QWEN7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
          "num_key_value_heads": 4, "vocab_size": 152064}
QWEN7B_PARAMS = 7_615_616_512
SEVEN_B = ModelSize(parameters=QWEN7B_PARAMS, config=QWEN7B)


def opd(*overrides):
    # the student's KV cache set: the figures below count it (null sizes it from the GPU's share on CUDA)
    return load_recipe(RECIPE, ["algorithm.name=opd", "teacher.path=/models/teacher",
                                "rollout.kv_cache_memory_bytes=268435456", *overrides], check_paths=False)


def test_on_cuda_the_teacher_is_eager_with_its_own_kv_cache_and_share():
    cfg = opd()
    max_len = sequence_length(cfg) + 1  # the teacher samples one token after a scored sequence
    o = teacher_engine_options(cfg, SEVEN_B, max_model_len=max_len, cuda=True, gpu_total=80 * GiB)
    assert o["enforce_eager"] is True  # no decode graphs: it only scores prefills
    assert "enable_sleep_mode" not in o  # one cumem allocator per process: the student's
    assert o["max_num_batched_tokens"] == TEACHER_BATCH_TOKENS == 8192
    # 2 (K, V) x 28 layers x 4 KV heads x 128 x 2 bytes = 57344 bytes a token, two steps of 8192 tokens
    assert o["kv_cache_memory_bytes"] == 57344 * 2 * 8192 == 939_524_096
    # its weights and KV cache as a share of the GPU, in thousandths rounded up: (15.23e9 + 0.94e9) / 85.9e9
    assert o["gpu_memory_utilization"] == 0.189
    assert math.ceil(1000 * (2 * QWEN7B_PARAMS + 939_524_096) / (80 * GiB)) == 189
    assert o["kv_cache_memory_bytes"] != cfg.rollout.kv_cache_memory_bytes  # not the student's
    assert o["gpu_memory_utilization"] != cfg.rollout.gpu_memory_utilization
    # vLLM's own validation takes them (no chunked prefill: the parityrl engine's)
    sched = SchedulerConfig(max_num_batched_tokens=o["max_num_batched_tokens"], max_num_seqs=o["max_num_seqs"],
                            enable_chunked_prefill=False, max_model_len=max_len, is_encoder_decoder=False)
    assert sched.max_num_batched_tokens == 8192 and sched.max_num_seqs == cfg.rollout.max_num_seqs
    CacheConfig(gpu_memory_utilization=o["gpu_memory_utilization"], kv_cache_memory_bytes=o["kv_cache_memory_bytes"])


def test_a_sequence_longer_than_the_batch_gets_a_batch_of_its_length():
    o = teacher_engine_options(opd(), SEVEN_B, max_model_len=10_000, cuda=True, gpu_total=80 * GiB)
    assert o["max_num_batched_tokens"] == 10_000
    SchedulerConfig(max_num_batched_tokens=10_000, max_num_seqs=o["max_num_seqs"], enable_chunked_prefill=False,
                    max_model_len=10_000, is_encoder_decoder=False)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8192\) is smaller than max_model_len"):
        SchedulerConfig(max_num_batched_tokens=8192, enable_chunked_prefill=False, max_model_len=10_000,
                        is_encoder_decoder=False)  # vLLM's refusal of a fixed 8192


def test_the_teacher_kv_cache_holds_one_step_in_vllms_blocks():
    kv = teacher_engine_options(opd(), SEVEN_B, max_model_len=89, cuda=True, gpu_total=80 * GiB)["kv_cache_memory_bytes"]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    blocks = kv // (QWEN7B["num_hidden_layers"] * spec.page_size_bytes)  # vLLM's page: one layer's block
    # the worst step: 8192 prompt tokens as 512 sequences of 16, each with its sampled token in a second block
    assert blocks >= 512 * 2
    # and one sequence of the run, whole
    assert blocks * 16 >= 89


def test_on_cpu_the_teacher_keeps_the_students_settings():
    cfg = opd()
    r = cfg.rollout
    o = teacher_engine_options(cfg, SEVEN_B, max_model_len=89, cuda=False, gpu_total=None)
    assert o == {"kv_cache_memory_bytes": r.kv_cache_memory_bytes, "gpu_memory_utilization": r.gpu_memory_utilization,
                 "enforce_eager": r.enforce_eager, "max_num_seqs": r.max_num_seqs}


def test_without_its_size_the_teacher_keeps_the_recipes_share_and_kv_of_unknown_attention():
    cfg = opd()
    o = teacher_engine_options(cfg, None, max_model_len=89, cuda=True, gpu_total=80 * GiB)
    assert o["gpu_memory_utilization"] == cfg.rollout.gpu_memory_utilization and o["enforce_eager"] is True
    assert o["kv_cache_memory_bytes"] == (cfg.rollout.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)  # no size
    sliding = ModelSize(QWEN7B_PARAMS, {**QWEN7B, "sliding_window": 4096})
    o = teacher_engine_options(cfg, sliding, max_model_len=89, cuda=True, gpu_total=80 * GiB)
    # the recipe's, else a fixed size its share is counted from (null would let vLLM fill a share sized without it)
    assert o["kv_cache_memory_bytes"] == (cfg.rollout.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)


def test_when_teacher_parity_loads_the_teacher_into_the_trainer():
    assert teacher_parity_measured(opd())  # null: the probe's schedule, which measures step 1
    assert teacher_parity_measured(opd("teacher.parity_every=5"))  # N: step 1, then every N
    assert not teacher_parity_measured(opd("teacher.parity_every=0"))
    # null with a probe that never comes within the run
    assert not teacher_parity_measured(opd("parity.probe_first=0", "parity.probe_every=100", "train.steps=60"))


# ---- the capacity check ----------------------------------------------------------------------------------


def test_a_7b_teacher_beside_a_7b_student_is_counted_on_the_gpu():
    cfg = opd()
    teacher = teacher_memory(cfg, SEVEN_B, max_model_len=89, cuda=True)
    assert (teacher.engine_weights, teacher.kv, teacher.trainer_copy) == (2 * QWEN7B_PARAMS, 939_524_096,
                                                                          2 * QWEN7B_PARAMS)
    # the student alone (15.2 GB of trainer weights, its engine's 15.2 GB and 256 MiB) fits a 40 GiB GPU
    gpu40 = Machine(host_available=None, gpu_total=40 * GiB)
    assert capacity_problems(cfg, "r", gpu40, SEVEN_B) == []
    p, share = capacity_problems(cfg, "r", gpu40, SEVEN_B, teacher=teacher)
    assert p.startswith("r: teacher.path = '/models/teacher': the colocated teacher (teacher.engine vllm) holds its "
                        "engine's weights (14.2 GiB) and KV cache (896.0 MiB), and its copy in the trainer for "
                        "teacher_parity/* (14.2 GiB, loaded on the first measured step and kept): 29.2 GiB beside the "
                        "student's 28.6 GiB, more than the 40.0 GiB of the GPU"), p
    assert "teacher.parity_every 0" in p and "teacher.engine server / vllm_url" in p
    # and the student's engine, started after the teacher's, finds less than its 0.3 of the GPU free
    assert share.startswith("r: rollout.gpu_memory_utilization = 0.3: ") and "the teacher's engine (15.1 GiB)" in share
    # an 80 GiB GPU holds both (lower bounds: 57.9 GiB)
    assert capacity_problems(cfg, "r", Machine(None, 80 * GiB), SEVEN_B, teacher=teacher) == []
    # without teacher parity, no copy in the trainer: 43.6 GiB fits 44 GiB
    no_copy = teacher_memory(opd("teacher.parity_every=0"), SEVEN_B, max_model_len=89, cuda=True)
    assert no_copy.trainer_copy == 0
    assert capacity_problems(cfg, "r", Machine(None, 44 * GiB), SEVEN_B, teacher=no_copy) == []
    assert len(capacity_problems(cfg, "r", Machine(None, 44 * GiB), SEVEN_B, teacher=teacher)) == 1


def test_the_students_engine_starts_after_the_teachers_engine():
    cfg = opd("rollout.gpu_memory_utilization=0.7")  # 56 GiB of 80 must be free when the student's engine starts
    teacher = teacher_memory(cfg, SEVEN_B, max_model_len=89, cuda=True)
    gpu = Machine(host_available=None, gpu_total=80 * GiB)
    assert capacity_problems(cfg, "r", gpu, SEVEN_B) == []  # the trainer's 14.2 GiB leave 65.8
    (p,) = capacity_problems(cfg, "r", gpu, SEVEN_B, teacher=teacher)
    assert p == ("r: rollout.gpu_memory_utilization = 0.7: vLLM starts only when that share of the GPU (56.0 GiB of "
                 "80.0 GiB) is free, and the trainer's weights (14.2 GiB) and the teacher's engine (15.1 GiB), "
                 "loaded first, leave at most 50.8 GiB; expected at most 0.634"), p


def test_an_fp8_teacher_engine_and_a_transformers_teacher():
    cfg = opd()
    fp8 = teacher_memory(cfg, SEVEN_B, max_model_len=89, cuda=True, fp8=True)
    assert fp8.engine_weights == QWEN7B_PARAMS and fp8.trainer_copy == 2 * QWEN7B_PARAMS  # the copy stays bf16
    hf = teacher_memory(opd("teacher.engine=hf"), SEVEN_B, max_model_len=89, cuda=True)
    assert (hf.engine_weights, hf.kv) == (2 * QWEN7B_PARAMS, 0)
    assert teacher_memory(opd("teacher.engine=vllm_url", "teacher.server_url=http://h:1"), SEVEN_B,
                          max_model_len=89, cuda=True) is None  # on a server: nothing here


def _model_dir(root: Path, params: int) -> str:
    """A model directory whose safetensors header says ``params`` parameters (one float32 vector)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, '
                                      '"num_key_value_heads": 2, "hidden_size": 64}')
    save_file({"w": torch.zeros(params)}, str(root / "model.safetensors"))
    return str(root)


def test_preflight_counts_a_teacher_at_hand_on_cpu(tmp_path):
    teacher_dir = _model_dir(tmp_path / "teacher", 1000)
    assert model_size(teacher_dir).parameters == 1000
    cfg = opd(f"teacher.path={teacher_dir}")
    kv = cfg.rollout.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES  # null: the CPU engine's own size
    student = ModelSize(parameters=1000, config={"model_type": "llama"})
    # the student's engine KV, its weights twice (2 bytes each), and the teacher: its engine's KV (the student's
    # setting on CPU), its weights and their copy for teacher_parity/*
    student_bytes = kv + 2 * 2000
    teacher_bytes = kv + 2 * 2000
    check_capacity(cfg, "r", student, Machine(host_available=student_bytes + teacher_bytes, gpu_total=None))
    with pytest.raises(RecipeError, match=r"^r: teacher.path = .*the colocated teacher \(teacher.engine vllm\) holds"):
        check_capacity(cfg, "r", student, Machine(host_available=student_bytes + teacher_bytes - 1, gpu_total=None))


# ---- the teacher's engine as training starts it ----------------------------------------------------------


def test_the_teacher_engine_is_started_with_its_own_options_on_cuda(monkeypatch, tmp_path):
    teacher_dir = _model_dir(tmp_path / "teacher", 1000)
    started = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(teacher_module, "gpu_total_bytes", lambda: 80 * GiB)
    monkeypatch.setattr(teacher_module, "start_vllm", lambda model_dir, **kw: started.update(kw, model=model_dir))
    cfg = opd(f"teacher.path={teacher_dir}")
    teacher_module.start_teacher_engine(cfg, teacher_dir, max_model_len=89, device="cuda:0")
    assert started["model"] == teacher_dir and started["max_model_len"] == 89
    expected = teacher_engine_options(cfg, model_size(teacher_dir), max_model_len=89, cuda=True, gpu_total=80 * GiB)
    assert {k: started[k] for k in expected} == expected
    assert started["enforce_eager"] is True and "enable_sleep_mode" not in started
    assert started["kv_cache_memory_bytes"] == 2 * 2 * 2 * 16 * 2 * 2 * 8192  # the directory's config, two steps
