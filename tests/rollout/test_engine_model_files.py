"""rollout.model_files: what the engine reads of a model directory before it starts."""
import json

from rollout.model_files import eos_token_ids, has_vision_tower


def test_a_vision_language_config_is_known_by_its_vision_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {"hidden_size": 64},
                                                      "eos_token_id": [2, 7]}))
    assert has_vision_tower(tmp_path) and eos_token_ids(tmp_path) == [2, 7]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    assert not has_vision_tower(tmp_path) and eos_token_ids(tmp_path) == [2]
    assert not has_vision_tower(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{not json")
    assert not has_vision_tower(tmp_path)
