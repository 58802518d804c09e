"""A model directory read cheaply before anything loads it (trainer/builtin/model_files.py), and a hub id checked
without retries (trainer/builtin/hub.py)."""
import json
import struct
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import HfApi
from safetensors.torch import save_file

import trainer.builtin.hub as hub
from trainer.builtin.model_files import (
    config_problem,
    parameter_count,
    safetensors_header,
    tokenizer_problem,
    weight_files,
)
from trainer.builtin.model_path import model_max_positions
from trainer.builtin.resolve import resolve_model_path

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def write_config(d, conf) -> None:
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(conf if isinstance(conf, str) else json.dumps(conf))


def test_a_sound_config_passes(tmp_path):
    write_config(tmp_path, LLAMA)
    assert config_problem(tmp_path) is None


@pytest.mark.parametrize("conf,expected", [
    ('{"model_type": ', "config.json is not valid JSON (Expecting value, line 1, column 16)"),
    ("[1]", "config.json holds list, expected a JSON object"),
    ({"hidden_size": 8}, "config.json has no model_type"),
    ({"model_type": "resnet"}, "config.json: model_type 'resnet' is not a causal language model"),
    ({"model_type": "qwen2_5_vl"}, "config.json: model_type 'qwen2_5_vl' is a vision-language model parityrl does "
                                   "not train yet; supported: idefics3, smolvlm"),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]},
     "config.json: architectures ['BertForMaskedLM']: not a causal language model"),
])
def test_config_problems(tmp_path, conf, expected):
    write_config(tmp_path, conf)
    assert config_problem(tmp_path).startswith(expected), config_problem(tmp_path)


def test_a_config_that_is_not_utf8(tmp_path):
    tmp_path.joinpath("config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    assert config_problem(tmp_path).startswith("config.json: byte 18 (line 1, column 19) is 0xff, not UTF-8")


def save(path, tensors) -> None:
    save_file(tensors, str(path))


def test_a_sound_checkpoint_gives_its_parameter_count(tmp_path):
    save(tmp_path / "model.safetensors", {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)})
    files, problem = weight_files(tmp_path)
    assert problem is None and files == [tmp_path / "model.safetensors"]
    header, problem = safetensors_header(files[0])
    assert problem is None and parameter_count([header]) == 3 * 4 + 5


def test_a_truncated_checkpoint_is_refused(tmp_path):
    f = tmp_path / "model.safetensors"
    save(f, {"a": torch.zeros(3, 4)})  # 48 bytes of data
    f.write_bytes(f.read_bytes()[:-10])
    assert safetensors_header(f)[1] == "model.safetensors is truncated: its header describes 48 bytes of tensor data, " \
                                       "the file holds 38"


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10**12) + b"x" * 100)
    assert "its first 8 bytes give a header of 1000000000000 bytes in a 108-byte file" in safetensors_header(f)[1]
    f.write_bytes(b"abc")
    assert "shorter than a safetensors header" in safetensors_header(f)[1]
    f.write_bytes(struct.pack("<Q", 4) + b"nope")
    assert "the header is not a JSON object" in safetensors_header(f)[1]


def test_a_tensor_whose_offsets_disagree_with_its_shape(tmp_path):
    f = tmp_path / "model.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    assert safetensors_header(f)[1] == "model.safetensors: tensor 'a' spans 12 bytes, its dtype and shape need 16"


def test_no_weights_and_missing_shards(tmp_path):
    assert weight_files(tmp_path)[1].startswith("no weights")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert weight_files(tmp_path) == ([], None)  # PyTorch weights: present, nothing cheap to check
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    save(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.zeros(2)})
    assert weight_files(tmp_path)[1] == ("model.safetensors.index.json names 1 missing shard(s): "
                                         "model-00002-of-00002.safetensors")


def test_tokenizer_problems(tmp_path):
    assert tokenizer_problem(tmp_path).startswith("no tokenizer (expected one of tokenizer.json")
    (tmp_path / "tokenizer.json").write_text('{"version": ')
    assert tokenizer_problem(tmp_path).startswith("tokenizer.json is not valid JSON")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    assert tokenizer_problem(tmp_path).startswith("tokenizer.json does not load as a tokenizer")


@pytest.fixture
def tiny_base_dir():
    return Path(resolve_model_path("builtin:tiny-base"))


def test_the_built_in_models_tokenizer_loads(tiny_base_dir):
    assert tokenizer_problem(tiny_base_dir) is None and config_problem(tiny_base_dir) is None


# --------------------------------------------------------------------------- hub ids


@pytest.fixture
def not_cached(monkeypatch):
    monkeypatch.setattr(hub, "cached_config", lambda repo_id: None)


def test_offline_and_not_cached_fails_at_once_naming_hf_hub_offline(monkeypatch, not_cached):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_network(*a, **k):
        raise AssertionError("offline: no request may be made")

    monkeypatch.setattr(HfApi, "model_info", no_network)
    problem = hub.hub_model_problem("org/model")
    assert "HF_HUB_OFFLINE is set" in problem and "hf download org/model" in problem


def test_a_cached_model_passes_offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "cached_config", lambda repo_id: "/cache/config.json")
    assert hub.hub_model_problem("org/model") is None


def test_an_unreachable_hub_is_one_request_with_a_time_limit(monkeypatch, not_cached):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    calls = []

    def unreachable(self, repo_id, *, timeout=None, **k):
        calls.append(timeout)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "model_info", unreachable)
    problem = hub.hub_model_problem("org/model")
    assert calls == [hub.PROBE_TIMEOUT_S]
    assert "did not answer within 5 s (ConnectionError: Name or service not known)" in problem
    assert "HF_HUB_OFFLINE=1" in problem


def test_an_invalid_hub_id_is_named(monkeypatch, not_cached):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    # the hub client validates the id before any request
    assert "neither a local directory nor a valid Hugging Face Hub id" in hub.hub_model_problem("a b/c d")


def test_the_context_length_reader_leaves_a_damaged_config_to_preflight(tmp_path):
    for raw in (b"[1]", b'{"max_position_embeddings": 7, "x": "\xff"}', b'{"model_type": '):
        (tmp_path / "config.json").write_bytes(raw)
        assert model_max_positions(str(tmp_path)) is None
    (tmp_path / "config.json").write_bytes(b'{"max_position_embeddings": 7}')
    assert model_max_positions(str(tmp_path)) == 7


def test_a_hub_dataset_offline_and_not_cached_fails_at_once(monkeypatch):
    monkeypatch.setattr(hub, "cached_dataset", lambda repo_id: False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_network(*a, **k):
        raise AssertionError("offline: no request may be made")

    monkeypatch.setattr(HfApi, "dataset_info", no_network)
    problem = hub.hub_dataset_problem("org/data")
    assert problem.startswith("neither a local file or directory nor a dataset in the Hugging Face cache"), problem
    assert "HF_HUB_OFFLINE is set" in problem and "hf download org/data --repo-type dataset" in problem


def test_a_hub_dataset_is_one_request_with_a_time_limit_and_cached_ones_none(monkeypatch, tmp_path):
    import datasets.config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    calls = []

    def answers(self, repo_id, *, timeout=None, **k):
        calls.append((repo_id, timeout))
        if repo_id == "org/missing":
            raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "dataset_info", answers)
    assert hub.hub_dataset_problem("org/data") is None and calls == [("org/data", hub.PROBE_TIMEOUT_S)]
    assert "did not answer within 5 s (ConnectionError" in hub.hub_dataset_problem("org/missing")
    # cached: in the hub cache, or prepared by datasets; no request
    (tmp_path / "hub" / "datasets--org--missing").mkdir(parents=True)
    (tmp_path / "datasets" / "other___set").mkdir(parents=True)
    calls.clear()
    assert hub.hub_dataset_problem("org/missing") is None and hub.hub_dataset_problem("other/set") is None
    assert calls == []


def test_the_recipe_names_a_hub_dataset_it_cannot_reach_before_anything_loads(monkeypatch, tmp_path):
    from trainer.config import RecipeError
    from trainer.lifecycle.preflight import load_recipe, preflight

    monkeypatch.setattr(hub, "cached_dataset", lambda repo_id: False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "grpo_tiny.yaml"
    cfg = load_recipe(recipe, ["data.source=org/data", f"logging.run_dir={tmp_path / 'run'}"])
    with pytest.raises(RecipeError) as e:
        preflight(cfg, str(recipe))  # what `parityrl train` runs before the model loads
    assert "data.source = 'org/data': neither a local file or directory nor a dataset" in str(e.value)
