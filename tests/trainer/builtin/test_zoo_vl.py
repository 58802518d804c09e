"""The tiny vision-language model: what its processor makes of a prompt with an image, and that the image reaches
the log-probs (a model that ignored it would make every vision-language parity figure vacuous)."""
import pytest
import torch

from trainer.builtin.zoo_vl import IMAGE_TOKENS, build_vl_model, ensure_vl_model
from trainer.data.tasks.shapes import shapes_example, shapes_question


@pytest.fixture(scope="module")
def built():
    return build_vl_model()


def test_one_placeholder_becomes_the_images_tokens_between_its_markers(built):
    _, processor = built
    tok = processor.tokenizer
    text = processor.apply_chat_template(shapes_question(), add_generation_prompt=True)
    assert text.startswith("<|bos|><|user|><image>How many") and text.endswith("<|end|><|assistant|>")
    raw = tok(text, add_special_tokens=False)["input_ids"]
    expanded = processor(text=[text], images=[[shapes_example(0)["image"]]])["input_ids"][0]
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<fake_token_around_image>", "<global-img>", "<image>")}
    at = raw.index(ids["<image>"])
    assert expanded == raw[:at] + [ids["<fake_token_around_image>"], ids["<global-img>"], *[ids["<image>"]] * IMAGE_TOKENS,
                                   ids["<fake_token_around_image>"]] + raw[at + 1:]
    assert IMAGE_TOKENS == 4 and len(tok) == 516  # the tiny tokenizer's 512, then the image specials


def test_the_image_moves_the_log_probs_and_the_same_image_gives_the_same_ones(built):
    model, processor = built
    text = processor.apply_chat_template(shapes_question(), add_generation_prompt=True)

    def logprobs(image):
        enc = processor(text=[text], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            return torch.log_softmax(model(**enc).logits[0, -1].float(), -1)

    a, b = shapes_example(0)["image"], shapes_example(1)["image"]
    assert torch.equal(logprobs(a), logprobs(a.copy()))
    assert (logprobs(a) - logprobs(b)).abs().max() > 0.1  # std-0.2 weights: an image is far above float noise


def test_the_cached_build_loads_back_as_built(tmp_path, built):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = ensure_vl_model(tmp_path)
    assert ensure_vl_model(tmp_path) == path
    model, processor = AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    for (name, p), (name2, q) in zip(built[0].state_dict().items(), model.state_dict().items()):
        assert name == name2 and torch.equal(p, q), name
    assert processor.chat_template == built[1].chat_template and processor.image_seq_len == IMAGE_TOKENS
