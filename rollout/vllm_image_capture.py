"""What an in-process vLLM engine consumed of each request's images: the fingerprint of every image's pixel tensor
and the placeholder span it fills, recorded as the request enters the engine core.

Where: ``engine_core.add_request`` of the LLM's engine (in process: ``InprocClient``), wrapped and read AFTER the
call. By then the engine core has filled each ``MultiModalFeatureSpec.data`` from its side of vLLM's processor
cache: read before, a repeated image's data is None (the front end sends only its hash on a cache hit,
``multimodal/cache/lru.py``). The tensors are the front end's processor output cast to the model dtype
(``multimodal/processing/context.py``), what the vision tower runs on; the front end is the same on CPU (Model
Runner V1) and CUDA (V2), so the capture is too. A request's key is its ``external_req_id``, the id
``LLM.generate`` gave it and its ``RequestOutput`` carries.

Only ``pixel_values`` is fingerprinted: the image itself. A model whose processor also sends a grid
(Qwen-VL's ``image_grid_thw``) or normalises on the device (``mm_device_do_normalize``: the front end's pixels are
then raw) needs its own rule before its fingerprints mean the same thing on both sides.
"""
from __future__ import annotations

import threading

from parity.input_digest import tensor_digest
from rollout.types import ImageInput


class ImageCapture:
    """Installs itself on ``llm``'s engine core; ``take(request_id)`` returns and forgets a request's images (only
    requests with images are recorded)."""

    def __init__(self, llm) -> None:
        core = llm.llm_engine.engine_core
        self._seen: dict[str, list[ImageInput]] = {}
        self._lock = threading.Lock()
        original = core.add_request

        def add_request(request, *args, **kwargs):
            out = original(request, *args, **kwargs)
            self._record(request)
            return out

        core.add_request = add_request

    def _record(self, request) -> None:
        images = consumed_images(request.external_req_id, request.mm_features)
        if images is None:  # text only: nothing to keep (a request without a record consumed no image)
            return
        with self._lock:
            self._seen[str(request.external_req_id)] = images

    def take(self, request_id: str) -> list[ImageInput]:
        """The images request ``request_id`` consumed, in placeholder order ([] for none)."""
        with self._lock:
            return self._seen.pop(request_id, [])


def consumed_images(request_id, mm_features) -> list[ImageInput] | None:
    """The images a request's ``mm_features`` (vLLM's ``MultiModalFeatureSpec`` list, in placeholder order) carry
    into the model, fingerprinted; None for a request without any. One reading for the in-process capture above and
    a server's workers (``vllm_plugins.image_capture``): both see the engine core's features, the data filled."""
    if not mm_features:
        return None
    images = []
    for feature in mm_features:
        if feature.modality != "image":
            continue
        if feature.data is None or "pixel_values" not in feature.data:
            raise RuntimeError(f"request {request_id}: an image reached the engine without its pixel_values (cache "
                               "miss on the engine's side)")
        pixels = feature.data["pixel_values"].data
        span = feature.mm_position
        images.append(ImageInput(digest=tensor_digest(pixels), shape=tuple(pixels.shape),
                                 dtype=str(pixels.dtype).removeprefix("torch."), offset=int(span.offset),
                                 length=int(span.length)))
    return images
