"""The policy's run-wide lines (trainer/models/policy.py): said once per launch, by the main process."""
import pytest

from trainer.config import LoraConfig
from trainer.models.policy import add_lora


@pytest.mark.parametrize("rank, said", [(None, 1), ("0", 1), ("1", 0)])
def test_the_lora_targets_line_comes_from_the_main_process_only(rank, said, monkeypatch, capsys):
    from trainer.builtin.zoo import build_arch_model

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)  # plain `parityrl train`: one process, the main one
    else:
        monkeypatch.setenv("RANK", rank)
    model, _ = build_arch_model("llama_tied")
    peft_model = add_lora(model, LoraConfig())
    assert capsys.readouterr().out.count("LoRA targets (LlamaForCausalLM): ") == said
    assert any(hasattr(m, "lora_A") for m in peft_model.modules())  # every rank adapts the model all the same
