"""`parityrl merge` (trainer/commands/merge.py): the merged model computes what base + adapter computed; bad inputs exit 2."""
import json
from pathlib import Path

import pytest
import torch

from trainer.cli import main as cli_main
from trainer.commands.merge import MergeError, merge_adapter

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _config(vocab_size: int, hidden: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _base(d: Path, tokenizer, dtype: torch.dtype, hidden: int = 64, seed: int = 0) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(_config(len(tokenizer), hidden)).to(dtype).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def _adapter(base_dir: Path, d: Path, seed: int = 1) -> Path:
    """A LoRA whose B is random (PEFT initialises B = 0, which would make any merge trivially equal)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM",
                                                  init_lora_weights=False))
    peft_model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from trainer.models.policy import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    """(bf16 base dir, its adapter dir), like an SFT run on the bf16 tiny model."""
    root = tmp_path_factory.mktemp("merge")
    base = _base(root / "base", tokenizer, torch.bfloat16)
    return base, _adapter(base, root / "adapter")


def _inputs(tokenizer):
    ids = tokenizer(["Tom has 3 pens and finds 5 more.", "3 + 5 = 8. The answer is 8."], padding=True,
                    return_tensors="pt")
    return ids["input_ids"], ids["attention_mask"]


def _peft_logits(base: Path, adapter: Path, dtype: torch.dtype, tokenizer) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter).eval()
    ids, mask = _inputs(tokenizer)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def _logits(model_dir: Path, tokenizer, dtype=None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, **({"dtype": dtype} if dtype else {})).eval()
    ids, mask = _inputs(tokenizer)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def test_merged_float32_equals_the_peft_model(tmp_path, pair, tokenizer):
    base, adapter = pair
    out = merge_adapter(str(base), str(adapter), str(tmp_path / "merged"), dtype="float32")
    assert not (out / "adapter_config.json").exists() and (out / "tokenizer.json").is_file()
    merged = _logits(out, tokenizer)
    reference = _peft_logits(base, adapter, torch.float32, tokenizer)  # bf16 base weights read in float32
    assert (reference - _logits(base, tokenizer, torch.float32)).abs().max() > 0.05  # the adapter does change them
    # float32 on both sides: only the order of additions differs (W + s*BA vs Wx + s*B(Ax))
    torch.testing.assert_close(merged, reference, atol=1e-4, rtol=1e-4)


def test_merged_bf16_matches_the_bf16_training_view_within_rounding(tmp_path, pair, tokenizer):
    base, adapter = pair
    out = merge_adapter(str(base), str(adapter), str(tmp_path / "merged"))  # auto: the base's bf16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    merged = _logits(out, tokenizer)
    reference = _peft_logits(base, adapter, torch.bfloat16, tokenizer)  # bf16 base + float32 LoRA, as in training
    # Tolerance: the merged weights are rounded once to bf16 (relative step 2^-8 = 0.4 %) and
    # every activation is bf16 on both sides; the logits here are below 1 in magnitude (bf16
    # step 2^-8 = 0.004 near 1), so 0.03 is a few steps -- and far below the adapter's own
    # effect on the logits (0.7). Measured: max |diff| 0.008 (float32 merge: 3e-7).
    assert (merged - reference).abs().max().item() < 0.03
    assert json.loads((out / "parityrl_merge.json").read_text())["dtype"] == "bfloat16"


def test_refuses_bad_inputs_with_the_path_named(tmp_path, pair, tokenizer):
    base, adapter = pair
    cases = {
        (str(tmp_path / "nope"), str(adapter)): "base = '.*nope': no such directory",
        (str(base), str(tmp_path / "nope")): "adapter = '.*nope': no such directory",
        (str(base), str(base)): "no adapter_config.json; expected a PEFT adapter directory",
        (str(adapter), str(adapter)): "base = .*: no config.json",
    }
    for (b, a), needle in cases.items():
        with pytest.raises(MergeError, match=needle):
            merge_adapter(b, a, str(tmp_path / "out"))
    checkpoint = tmp_path / "step_000010"
    checkpoint.mkdir()
    (checkpoint / "adapter").symlink_to(adapter, target_is_directory=True)
    with pytest.raises(MergeError, match="did you mean .*step_000010/adapter"):
        merge_adapter(str(base), str(checkpoint), str(tmp_path / "out"))
    wider = _base(tmp_path / "wider", tokenizer, torch.bfloat16, hidden=128)
    with pytest.raises(MergeError, match="does not fit base"):
        merge_adapter(str(wider), str(adapter), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_refuses_an_existing_nonempty_out(tmp_path, pair):
    base, adapter = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(MergeError, match="not empty"):
        merge_adapter(str(base), str(adapter), str(out))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (merge_adapter(str(base), str(adapter), str(empty)) / "config.json").is_file()  # an empty one is fine


def test_warns_when_merged_into_another_base_of_the_same_shape(tmp_path, pair, tokenizer):
    base, adapter = pair
    other = _base(tmp_path / "other", tokenizer, torch.bfloat16, seed=7)
    with pytest.warns(UserWarning, match="records base"):
        merge_adapter(str(other), str(adapter), str(tmp_path / "out"))


def test_cli_exit_codes(tmp_path, pair, capsys):
    base, adapter = pair
    assert cli_main(["merge", str(base), str(tmp_path / "missing"), "--out", str(tmp_path / "o1")]) == 2
    assert "parityrl merge: adapter" in capsys.readouterr().err
    assert cli_main(["merge", str(base), str(adapter), "--out", str(tmp_path / "o2")]) == 0
    assert "merged" in capsys.readouterr().out and (tmp_path / "o2" / "model.safetensors").is_file()
