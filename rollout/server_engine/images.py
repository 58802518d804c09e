"""A vision-language prompt's images to a server and back: what each request sends, and what the server's workers
say it consumed (package docstring, Images).

Sent: each image as a PNG ``data:`` URL in the token route's ``content_parts`` (``image_url``), beside the prompt's
ids with one placeholder per image; vLLM's processor decodes it and expands the placeholder, as the colocated engine
does with the PIL image (PNG is lossless: the server decodes the pixels the trainer's processor reads). The answer
(``return_token_ids``) holds the prompt as the engine consumed it, expanded. The pixels themselves are not in the
answer: the workers fingerprint them (``rollout.vllm_plugins.image_capture``) and the client takes the
fingerprints by request id, so the trainer's identity check compares the server's own tensors with its own.

Why not the route's other way in, ``features`` (each image's processed tensors, serialised): the client would send
the trainer's pixels, equal on both sides by construction, and the check would verify nothing about the
server's processor; it also needs vLLM's own serialiser and field layout in the trainer process.
"""
from __future__ import annotations

import base64
import io
import json
from typing import Any, Sequence

from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.http_channel import _Http
from rollout.types import ImageInput


def image_parts(images: Sequence[Any]) -> list[dict]:
    """The token route's ``content_parts`` for one prompt's images (PIL), in placeholder order."""
    parts = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        parts.append({"type": "image_url", "url": url})
    return parts


def check_image_server(info: dict, url: str, max_images: int) -> None:
    """ServerEngineError unless the server takes ``max_images`` images a prompt and hands its workers the
    normalised pixels the trainer's processor gives (``parityrl_server_info``'s ``images``)."""
    got = info.get("images")
    restart = "restart it with `parityrl serve <recipe>` for this recipe"
    if not got:
        raise ServerEngineError(f"vLLM server at {url} serves text only (started without a tokenizer or image "
                                f"settings), and this recipe's prompts hold images: {restart}")
    if int(got["limit"]) < max_images:
        raise ServerEngineError(f"vLLM server at {url} takes {got['limit']} image(s) a prompt, expected >= "
                                f"{max_images} (data.max_images_per_prompt): {restart}")
    if got["device_normalize"]:
        raise ServerEngineError(f"vLLM server at {url} normalises images on the device (mm_device_do_normalize): the "
                                f"pixels it consumes are raw, the trainer's normalised, and no identity check could "
                                f"hold: {restart}")


def take_images(http: _Http, request_ids: list[str]) -> list[list[ImageInput]]:
    """The images each request consumed, from the server's workers (rank 0's: every rank of a tensor-parallel group
    gets the same inputs); an answer of another shape is an error."""
    out = http.call("POST", "/collective_rpc", f"images of {len(request_ids)} requests",
                    json={"method": "parityrl_take_images", "args": [json.dumps(request_ids)]})
    try:
        got = out["results"][0]
        if len(got) != len(request_ids):
            raise ValueError(f"{len(got)} answers")
        return [[ImageInput(digest=str(i["digest"]), shape=tuple(int(d) for d in i["shape"]), dtype=str(i["dtype"]),
                            offset=int(i["offset"]), length=int(i["length"])) for i in images] for images in got]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ServerEngineError(f"vLLM server at {http.url}: asked for the images of {len(request_ids)} requests, it "
                                f"answered {out!r:.300} ({type(e).__name__}: {e})") from None


def expanded_prompt(url: str, s: int, resp: dict, sent: list[int]) -> list[int]:
    """The prompt the engine consumed (``return_token_ids``): its placeholders expanded, so at least as long as the
    ids sent."""
    ids = resp.get("prompt_token_ids") if isinstance(resp, dict) else None
    if not isinstance(ids, list) or len(ids) < len(sent) or not all(isinstance(t, int) for t in ids):
        raise ServerEngineError(f"vLLM server at {url}, request {s}: asked for the prompt it consumed "
                                f"(return_token_ids), it answered {ids!r:.200}")
    return ids
