"""A pending batch's data rows in a checkpoint's JSON, and back: a vision-language row's images (PIL) as PNG, raw
bytes as base64, everything else as it is.

Why PNG: a row's images are RGB as the sampler read them (``trainer.vision.images``), and PNG stores RGB without
loss, so a resumed run's rows give its samples table and any reward the same pixels. The trainer's pixel tensors of
the batch are stored apart, bit for bit (``trainer.sampling.async_prefetch``)."""
from __future__ import annotations

import base64
import io
from typing import Any

PNG, BYTES = "__png__", "__bytes__"


def encode_value(value: Any) -> Any:
    """``value`` with every PIL image and every bytes object in it (lists, tuples, dicts) made JSON."""
    from PIL import Image  # late: Pillow is needed only where a row holds an image

    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return {PNG: base64.b64encode(buf.getvalue()).decode("ascii")}
    if isinstance(value, (bytes, bytearray)):
        return {BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {k: encode_value(v) for k, v in value.items()}
    return value


def decode_value(value: Any) -> Any:
    """The inverse of ``encode_value`` (a tuple comes back as a list, as JSON gives it)."""
    if isinstance(value, dict):
        if set(value) == {PNG}:
            from PIL import Image  # late: as above

            image = Image.open(io.BytesIO(base64.b64decode(value[PNG])))
            image.load()
            return image
        if set(value) == {BYTES}:
            return base64.b64decode(value[BYTES])
        return {k: decode_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value
