"""save_model_dir writes a model + tokenizer atomically, without Transformers' per-shard progress bar on the console
(the warm start of a first `parityrl train` is built through it), and leaves the bar setting as it found it."""
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from trainer.models.policy import load_tokenizer
from trainer.supervised.sft import save_model_dir


def test_the_save_draws_no_bar_and_restores_the_setting(tmp_path, tiny_model_dir, capfd):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    hf_logging.enable_progress_bar()
    save_model_dir(model, load_tokenizer(tiny_model_dir), tmp_path / "out", extra={"k": 1})
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err
    assert hf_logging.is_progress_bar_enabled()
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "parityrl_sft.json").is_file()
    # the same save with the bar shown draws it: the check above can fail
    model.save_pretrained(tmp_path / "plain")
    assert "Writing model shards" in "".join(capfd.readouterr())
