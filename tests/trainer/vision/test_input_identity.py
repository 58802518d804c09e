"""The input identity check on hand-made engine records: identical inputs pass with mm/inputs_equal 1; each planted
difference (another processor's pixels, an image the engine did not get, a prompt expanded otherwise, a span
elsewhere) stops with one line naming the sample, the image and the quantity."""
from dataclasses import replace

import pytest
import torch

from parity.input_digest import tensor_digest
from rollout.types import ImageInput, Rollouts
from trainer.builtin.zoo_vl import build_vl_model
from trainer.data.tasks.shapes import shapes_example, shapes_question
from trainer.vision.identity import InputsDiffer, TrainerInputs, check_inputs, input_differences
from trainer.vision.pixels import prompt_pixels

DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def processor():
    return build_vl_model()[1]


def _trainer_side(processor, images):
    text = processor.apply_chat_template(shapes_question(), add_generation_prompt=True)
    ids = processor(text=[text], images=[images])["input_ids"][0]
    return TrainerInputs(ids=list(ids), pixels=prompt_pixels(processor.image_processor, images))


def _engine_record(inputs: TrainerInputs, image_token_id: int) -> list[ImageInput]:
    """What the engine's capture records for these inputs: each image's pixels in the engine's dtype, and the span of
    its tokens with their markers (one before, one after)."""
    first = inputs.ids.index(image_token_id)
    return [ImageInput(tensor_digest(v, DTYPE), tuple(v.shape), "bfloat16", first - 2, 7) for v in inputs.pixels.values]


def _rollouts(inputs: list[TrainerInputs], records: list[list[ImageInput]], group: int = 2) -> Rollouts:
    s = len(inputs) * group
    return Rollouts(prompt_ids=[inputs[k // group].ids for k in range(s)], completion_ids=[[5]] * s,
                    rollout_logprobs=[[-1.0]] * s, finish_reasons=["stop"] * s, group_size=group,
                    images=[records[k // group] for k in range(s)])


def test_identical_inputs_pass_and_are_counted(processor):
    tok_id = processor.image_token_id
    a, b = _trainer_side(processor, [shapes_example(0)["image"]]), _trainer_side(processor, [shapes_example(1)["image"]])
    r = _rollouts([a, b], [_engine_record(a, tok_id), _engine_record(b, tok_id)])
    assert check_inputs(r, [a, b], tok_id, DTYPE, step=3) == {"mm/inputs_equal": 1.0, "mm/images": 4.0}


def test_another_processors_pixels_are_named_by_sample_and_image(processor):
    """The trainer's processor resizing to 42 pixels where the engine's ran at 56: the fingerprints differ."""
    tok_id = processor.image_token_id
    image = shapes_example(0)["image"]
    ours = _trainer_side(processor, [image])
    engine_side = replace(ours, pixels=prompt_pixels(processor.image_processor, [image.resize((42, 42)).resize((56, 56))]))
    r = _rollouts([ours], [_engine_record(engine_side, tok_id)])
    with pytest.raises(InputsDiffer, match=r"step 7: .*sample 0 \(prompt 0\), image 0: pixel tensors differ "
                                           r"\(engine bfloat16 \[3, 56, 56\] sha256 .*\(1 more sample\(s\) differ\)"):
        check_inputs(r, [ours], tok_id, DTYPE, step=7)
    # the same pixels fingerprinted in another dtype are other bits: the trainer's side is cast to the engine's
    assert input_differences(r, [engine_side], tok_id, torch.float32)


def test_an_image_the_engine_did_not_get_is_named(processor):
    tok_id = processor.image_token_id
    ours = _trainer_side(processor, [shapes_example(0)["image"]])
    r = _rollouts([ours, ours], [_engine_record(ours, tok_id), []])
    assert input_differences(r, [ours, ours], tok_id, DTYPE) == [
        "sample 2 (prompt 1): the engine consumed 0 image(s), the trainer's prompt holds 1",
        "sample 3 (prompt 1): the engine consumed 0 image(s), the trainer's prompt holds 1"]


def test_a_prompt_expanded_otherwise_names_the_first_differing_position(processor):
    """The engine expanding one image into 5 tokens where the trainer's processor wrote 4 (another image_seq_len)."""
    tok_id = processor.image_token_id
    ours = _trainer_side(processor, [shapes_example(0)["image"]])
    at = ours.ids.index(tok_id) + 4
    engine_ids = ours.ids[:at] + [tok_id] + ours.ids[at:]
    r = _rollouts([replace(ours, ids=engine_ids)], [_engine_record(ours, tok_id)], group=1)
    (line,) = input_differences(r, [ours], tok_id, DTYPE)
    assert line == (f"sample 0 (prompt 0): expanded prompt ids differ: engine {len(ours.ids) + 1} ids, trainer's "
                    f"processor {len(ours.ids)} (first difference at position {at}: engine {tok_id}, trainer "
                    f"{ours.ids[at]})")


def test_a_span_that_misses_the_trainers_image_tokens_is_named(processor):
    tok_id = processor.image_token_id
    ours = _trainer_side(processor, [shapes_example(0)["image"]])
    (record,) = _engine_record(ours, tok_id)
    r = _rollouts([ours], [[replace(record, offset=record.offset + 3)]], group=1)
    first = ours.ids.index(tok_id)
    (line,) = input_differences(r, [ours], tok_id, DTYPE)
    assert line == (f"sample 0 (prompt 0), image 0: the engine's placeholder span [{record.offset + 3}, "
                    f"{record.offset + 10}) does not hold the trainer's image tokens at [{first}, {first + 4})")


def test_text_only_prompts_need_no_images(processor):
    tok_id = processor.image_token_id
    text = processor.tokenizer("hello")["input_ids"]
    plain = TrainerInputs(ids=text, pixels=prompt_pixels(processor.image_processor, []))
    r = _rollouts([plain], [[]], group=1)
    assert check_inputs(r, [plain], tok_id, DTYPE, step=1) == {"mm/inputs_equal": 1.0, "mm/images": 0.0}


def test_an_image_split_into_crops_keeps_its_views_together():
    """do_image_splitting: the processor gives 2 x 2 crops and a global view per image (rows, cols 2, 2): the
    prompt's pixels hold 10 tensors for 2 images, ``views`` (5, 5), and image j's values are its own 5, as the engine
    runs them (one tensor per image); without splitting, one view each."""
    from trainer.builtin.zoo_vl import build_vl_model as build

    image_processor = build()[1].image_processor
    a, b = shapes_example(0)["image"], shapes_example(1)["image"]
    split = prompt_pixels(image_processor, [a, b], {"do_image_splitting": True, "size": {"longest_edge": 112}})
    assert split.views == (5, 5) and split.count == 2 and split.num_views == 10
    assert torch.equal(split.image_values(1), split.values[5:10])
    whole = prompt_pixels(image_processor, [a, b])
    assert whole.views == (1, 1) and whole.count == 2 and whole.image_values(1).shape == (1, 3, 56, 56)
    assert prompt_pixels(image_processor, []).count == 0
