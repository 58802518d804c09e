"""``decoder_depth``: the language model's depth, read where a vision-language config holds it (its text config);
`parityrl compare` and the doctor judge a mismatch by the level at that depth."""
from types import SimpleNamespace

import pytest
from transformers import Idefics3Config, LlamaConfig

from trainer.models.architecture import decoder_depth


def test_a_causal_lm_and_a_vision_language_model_give_their_decoders_depth():
    assert decoder_depth(LlamaConfig(num_hidden_layers=3)) == 3
    # Idefics3's own config has no num_hidden_layers: reading it there raises AttributeError
    vl = Idefics3Config(text_config={"model_type": "llama", "num_hidden_layers": 5})
    assert decoder_depth(vl) == 5


def test_a_config_without_a_depth_takes_the_default_or_is_refused():
    config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(hidden_size=64))
    assert decoder_depth(config, default=4) == 4
    with pytest.raises(AttributeError, match="no num_hidden_layers"):
        decoder_depth(config)
