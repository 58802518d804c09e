"""A pending batch's rows through a checkpoint's JSON: a vision-language row's images come back with the same pixels
(PNG, lossless for the RGB images the sampler reads), bytes as they were, other values untouched."""
import json

import numpy as np
from PIL import Image

from trainer.sampling.row_codec import decode_value, encode_value


def test_images_and_bytes_round_trip_through_json_and_other_values_are_untouched():
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (9, 7, 3), dtype=np.uint8), "RGB")
    row = {"prompt": "How many?", "answer": 3, "image": image, "more": [image, b"\x00\x01raw"],
           "meta": {"bytes": b"\xff", "path": None}}
    back = decode_value(json.loads(json.dumps(encode_value([row]))))[0]
    assert back["prompt"] == "How many?" and back["answer"] == 3 and back["meta"] == {"bytes": b"\xff", "path": None}
    assert back["more"][1] == b"\x00\x01raw"
    for got in (back["image"], back["more"][0]):
        assert got.mode == "RGB" and got.size == (7, 9)
        assert np.array_equal(np.asarray(got), np.asarray(image))
    assert encode_value({"a": [1, "x", None]}) == {"a": [1, "x", None]}
