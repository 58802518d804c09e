"""The trainer's forward on a vision-language batch: the fused log-probs with the images' features at the prompt's
placeholders equal Transformers' own forward; a sampled placeholder id stays text, as the engine embeds it; rows
whose placeholders and images disagree are refused by row."""
import pytest
import torch

from trainer.builtin.zoo_vl import build_vl_model
from trainer.data.tasks.shapes import shapes_example, shapes_question
from trainer.models.batch import build_token_batch
from trainer.models.policy import completion_logprobs
from trainer.vision.pixels import prompt_pixels, vision_batch


@pytest.fixture(scope="module")
def vl():
    model, processor = build_vl_model()
    return model.eval(), processor


def _vision(processor, images_per_row, image_token_id):
    return vision_batch([prompt_pixels(processor.image_processor, x) for x in images_per_row], image_token_id)


def _prompt(processor, image):
    text = processor.apply_chat_template(shapes_question(), add_generation_prompt=True)
    return text, processor(text=[text], images=[[image]])["input_ids"][0]


def _own(model, processor, text, image, completion):
    enc = processor(text=[text], images=[[image]], return_tensors="pt")
    ids = torch.cat([enc["input_ids"][0], torch.tensor(completion)])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=enc["pixel_values"],
                       pixel_attention_mask=enc["pixel_attention_mask"]).logits[0, enc["input_ids"].shape[1] - 1:-1]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_fused_logprobs_with_images_equal_the_models_own_forward(vl):
    model, processor = vl
    images = [shapes_example(0)["image"], shapes_example(1)["image"]]
    (text, p0), (_, p1) = _prompt(processor, images[0]), _prompt(processor, images[1])
    text_only = processor.tokenizer(processor.apply_chat_template([{"role": "user", "content": "Hi?"}],
                                                                  add_generation_prompt=True))["input_ids"]
    completions = [[300, 301, 302, 2], [40, 41], [7, 8, 9]]
    batch = build_token_batch([p0, p1, text_only], completions, pad_id=0)
    batch.vision = _vision(processor, [[images[0]], [images[1]], []], model.config.image_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=1.0)
    for row, image in enumerate(images):
        own = _own(model, processor, text, image, completions[row])
        assert (lp[row, :len(completions[row])].double() - own).abs().max() < 1e-5, row
    # an image changes what the rows score: the two image rows' first tokens are not scored alike
    swapped = build_token_batch([p0], [completions[0]], pad_id=0)
    swapped.vision = _vision(processor, [[images[1]]], model.config.image_token_id)
    with torch.no_grad():
        other, _ = completion_logprobs(model, swapped, temperature=1.0)
    assert (other[0, :4] - lp[0, :4]).abs().max() > 1e-2


def test_a_sampled_placeholder_id_is_text_as_the_engine_embeds_it(vl):
    """The reference: Transformers with the prompt's pixels, then the completion fed over its KV cache without
    pixels (no merge there: the sampled id is embedded as a token)."""
    model, processor = vl
    image = shapes_example(2)["image"]
    text, p = _prompt(processor, image)
    placeholder = model.config.image_token_id
    completion = [300, placeholder, 301, placeholder, 2]
    batch = build_token_batch([p], [completion], pad_id=0)
    batch.vision = _vision(processor, [[image]], placeholder)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=1.0)
        enc = processor(text=[text], images=[[image]], return_tensors="pt")
        first = model(**enc, use_cache=True)
        rest = model(input_ids=torch.tensor([completion[:-1]]), past_key_values=first.past_key_values)
        logits = torch.cat([first.logits[0, -1:], rest.logits[0]]).double()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    assert (lp[0].double() - ref).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="Number of elements"):  # what merging by id does with it
        model(input_ids=torch.cat([enc["input_ids"][0], torch.tensor(completion)])[None],
              pixel_values=enc["pixel_values"], pixel_attention_mask=enc["pixel_attention_mask"])


def test_placeholders_and_images_that_disagree_are_refused_by_row(vl):
    model, processor = vl
    image = shapes_example(0)["image"]
    _, p = _prompt(processor, image)
    batch = build_token_batch([p, p], [[5], [6]], pad_id=0)
    batch.vision = _vision(processor, [[image], []], model.config.image_token_id)
    with pytest.raises(ValueError, match="row 1: its prompt holds 4 image placeholder positions for 0 image"):
        completion_logprobs(model, batch, temperature=1.0)


def test_micro_batches_take_their_rows_images(vl):
    model, processor = vl
    images = [shapes_example(i)["image"] for i in range(3)]
    prompts = [_prompt(processor, im)[1] for im in images]
    batch = build_token_batch(prompts, [[5, 6], [7], [8, 9, 10]], pad_id=0)
    batch.vision = _vision(processor, [[im] for im in images], model.config.image_token_id)
    with torch.no_grad():
        whole, _ = completion_logprobs(model, batch, temperature=1.0)
        part, _ = completion_logprobs(model, batch.select(slice(1, 3)), temperature=1.0)
        picked, _ = completion_logprobs(model, batch.select(torch.tensor([2, 0])), temperature=1.0)
    assert (part[:, :3] - whole[1:, :3]).abs().max() < 1e-5
    assert (picked[0, :3] - whole[2, :3]).abs().max() < 1e-5 and (picked[1, :2] - whole[0, :2]).abs().max() < 1e-5
