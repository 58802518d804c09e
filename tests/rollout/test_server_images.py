"""Images in server mode, without a server: what a request sends (a lossless PNG of each image), what the workers
record of each new request's images and hand back by the caller's id, and how a malformed answer is refused."""
import base64
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from parity.input_digest import tensor_digest
from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.images import expanded_prompt, image_parts, take_images
from rollout.types import ImageInput
from rollout.vllm_plugins.image_capture import serve_images, take_images as worker_take_images

REPO = Path(__file__).resolve().parents[2]


def _image(seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (9, 7, 3), generator=g, dtype=torch.uint8).numpy())


def test_each_image_goes_as_a_png_that_decodes_to_the_same_pixels():
    images = [_image(0), _image(1)]
    parts = image_parts(images)
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    for part, image in zip(parts, images):
        head, data = part["url"].split(",", 1)
        assert head == "data:image/png;base64"
        back = Image.open(io.BytesIO(base64.b64decode(data)))
        assert back.mode == image.mode and back.tobytes() == image.tobytes()


def _feature(pixels, offset, length, modality="image"):
    return SimpleNamespace(modality=modality, data={"pixel_values": SimpleNamespace(data=pixels)},
                           mm_position=SimpleNamespace(offset=offset, length=length))


class _Worker:
    def __init__(self):
        self.calls = []

    def execute_model(self, scheduler_output):
        self.calls.append(scheduler_output)
        return "output"


def test_the_workers_record_each_new_requests_images_and_hand_them_out_by_the_callers_id():
    a, b = torch.rand(1, 3, 4, 4), torch.rand(2, 3, 4, 4, dtype=torch.float64)
    worker = _Worker()
    serve_images(worker)
    step = SimpleNamespace(scheduled_new_reqs=[
        # the token route's prefix and the engine's random suffix around the caller's id
        SimpleNamespace(req_id="generate-tokens-parityrl-ab12-0-x7y8z9w0", mm_features=[_feature(a, 5, 6)]),
        SimpleNamespace(req_id="generate-tokens-parityrl-ab12-1-q1w2e3r4",
                        mm_features=[_feature(a, 3, 6), _feature(b, 12, 8)]),
        SimpleNamespace(req_id="generate-tokens-parityrl-ab12-2-m1n2b3v4", mm_features=[]),  # text: not kept
    ])
    assert worker.execute_model(step) == "output" and worker.calls == [step]  # the step itself runs unchanged
    worker.execute_model(SimpleNamespace(scheduled_new_reqs=[]))  # a decode step: nothing new
    got = worker_take_images(worker, ["parityrl-ab12-1", "parityrl-ab12-2", "parityrl-ab12-0"])
    assert got == [
        [{"digest": tensor_digest(a), "shape": (1, 3, 4, 4), "dtype": "float32", "offset": 3, "length": 6},
         {"digest": tensor_digest(b), "shape": (2, 3, 4, 4), "dtype": "float64", "offset": 12, "length": 8}],
        [],
        [{"digest": tensor_digest(a), "shape": (1, 3, 4, 4), "dtype": "float32", "offset": 5, "length": 6}]]
    assert worker_take_images(worker, ["parityrl-ab12-0"]) == [[]]  # taken once: forgotten
    serve_images(worker)  # a second trainer connects: installed once, earlier records forgotten
    worker.execute_model(step)
    assert len(worker.calls) == 3
    serve_images(worker)
    assert worker_take_images(worker, ["parityrl-ab12-0"]) == [[]]


def test_an_image_that_reaches_the_worker_without_pixels_is_an_error_naming_the_request():
    worker = _Worker()
    serve_images(worker)
    feature = SimpleNamespace(modality="image", data=None, mm_position=SimpleNamespace(offset=0, length=1))
    with pytest.raises(RuntimeError, match="request r-1: an image reached the engine without its pixel_values"):
        worker.execute_model(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r-1",
                                                                                 mm_features=[feature])]))


class _Http:
    url = "http://server"

    def __init__(self, answer):
        self.answer, self.sent = answer, []

    def call(self, method, path, action, *, json=None, timeout=None):
        self.sent.append((method, path, json))
        return self.answer


def test_the_clients_reading_of_the_workers_answer():
    one = {"digest": "d", "shape": [1, 3, 4, 4], "dtype": "float32", "offset": 5, "length": 6}
    http = _Http({"results": [[[one], []], [[one], []]]})  # two tensor-parallel ranks: rank 0's is read
    assert take_images(http, ["a", "b"]) == [[ImageInput("d", (1, 3, 4, 4), "float32", 5, 6)], []]
    assert http.sent[0][2] == {"method": "parityrl_take_images", "args": ['["a", "b"]']}
    with pytest.raises(ServerEngineError, match="asked for the images of 2 requests"):
        take_images(_Http({"results": [[[one]]]}), ["a", "b"])
    with pytest.raises(ServerEngineError, match="KeyError"):
        take_images(_Http({"results": [[[{"digest": "d"}], []]]}), ["a", "b"])


def test_the_expanded_prompt_is_read_from_the_answer_or_refused():
    assert expanded_prompt("u", 0, {"prompt_token_ids": [1, 7, 7, 7, 2]}, [1, 7, 2]) == [1, 7, 7, 7, 2]
    with pytest.raises(ServerEngineError, match="request 3: asked for the prompt it consumed"):
        expanded_prompt("u", 3, {"prompt_token_ids": None}, [1, 7, 2])
    with pytest.raises(ServerEngineError, match="request 3"):
        expanded_prompt("u", 3, {"prompt_token_ids": [1]}, [1, 7, 2])


def test_a_vision_language_recipes_server_loads_the_tokenizer_and_takes_the_colocated_engines_image_settings():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from trainer.commands.serve import image_flags, serve_command
    from trainer.lifecycle.preflight import load_recipe

    cfg = load_recipe(REPO / "recipes" / "grpo_vl_tiny.yaml", [
        "rollout.lora_sync=merged", "data.max_images_per_prompt=2",
        "data.image_processor={image_mean: [0.4, 0.4, 0.4], image_std: [0.3, 0.3, 0.3]}"], check_paths=False)
    argv, _ = serve_command(cfg, cuda=False, model_dir="/m")
    assert "--skip-tokenizer-init" not in argv  # vLLM's multimodal processor expands the placeholders with it
    flags = image_flags(cfg)
    assert all(f in argv for f in flags)
    # what vLLM makes of them: the options the colocated engine starts with (rollout.vllm_engine.image_options)
    args = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "/m", *flags])
    assert args.limit_mm_per_prompt == {"image": 2} and args.mm_device_do_normalize is False
    assert args.mm_processor_kwargs == {"image_mean": [0.4, 0.4, 0.4], "image_std": [0.3, 0.3, 0.3]}
    text = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [], check_paths=False)
    assert image_flags(text) == ["--skip-tokenizer-init"]  # a text recipe's server: token ids only
