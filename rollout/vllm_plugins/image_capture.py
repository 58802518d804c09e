"""What a server's workers received of each request's images: the fingerprint of every image's pixel tensor and the
placeholder span it fills (``rollout.types.ImageInput``), read as the request first reaches the worker.

Where: the worker's ``execute_model(scheduler_output)``, wrapped; every request scheduled for the first time is in
``scheduler_output.scheduled_new_reqs`` with its ``mm_features``, their data filled by the engine core from its side
of vLLM's processor cache (``NewRequestData``, ``vllm/v1/core/sched/output.py``): the tensors the vision tower runs
on, as the colocated engine's capture reads them at the engine core (``rollout.vllm_image_capture``, whose reading
this shares). ``Worker.execute_model`` is the entry of both model runners (V1 on CPU, V2 on CUDA), so the hook
does not depend on either's internals; only the CPU case has run.

A server serves whatever arrives: it records from the moment a trainer connects (``serve_images``) every request
that holds an image, and a trainer takes its requests' records by id after each batch (``take_images``), the ids
matched through the engine's suffix and the token route's prefix (``route_capture.request_names``). A record never
taken (a request its caller abandoned) stays until the next trainer connects.
"""
from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Sequence

from rollout.types import ImageInput
from rollout.vllm_image_capture import consumed_images
from rollout.vllm_plugins.route_capture import request_names

__all__ = ["ImageRecorder", "serve_images", "take_images"]

ATTR = "_parityrl_images"


class ImageRecorder:
    """Per engine request id, the images it consumed (requests without an image are not kept)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seen: dict[str, list[ImageInput]] = {}

    def reset(self) -> None:
        with self._lock:
            self.seen = {}

    def record(self, scheduler_output) -> None:
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or []:
            images = consumed_images(new.req_id, new.mm_features)
            if images is not None:
                with self._lock:
                    self.seen[str(new.req_id)] = images

    def take(self, request_ids: Sequence[str]) -> list[list[ImageInput]]:
        """The images of each of the caller's request ids, in order ([] for a request that held none); those
        records are forgotten."""
        with self._lock:
            keys = list(self.seen)
            names = request_names({k: i for i, k in enumerate(keys)})
            out = []
            for rid in request_ids:
                number = names.get(rid)
                out.append(self.seen.pop(keys[number], []) if number is not None else [])
            return out


def serve_images(worker, reset: bool = True) -> None:
    """Record the images of every request the worker runs from now on (the hook is installed once); ``reset``
    forgets what earlier clients left."""
    recorder = getattr(worker, ATTR, None)
    if recorder is None:
        recorder = ImageRecorder()
        execute = worker.execute_model

        def recorded_execute(scheduler_output, *args, **kwargs):
            recorder.record(scheduler_output)
            return execute(scheduler_output, *args, **kwargs)

        worker.execute_model = recorded_execute
        setattr(worker, ATTR, recorder)
    elif reset:
        recorder.reset()


def take_images(worker, request_ids: Sequence[str]) -> list[list[dict]]:
    """The images of each request id, as plain dicts for the wire (``ImageInput``'s fields)."""
    recorder = getattr(worker, ATTR, None)
    if recorder is None:
        raise ValueError("images: this server's workers record no images (parityrl_serve_images was never called)")
    return [[asdict(i) for i in images] for images in recorder.take(request_ids)]
