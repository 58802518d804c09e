"""What ``parity.routing_replay`` means for one run: replay the engine's routes, only measure them, or neither.

One rule, read before anything loads (``trainer.lifecycle.preflight``) and again when the run starts
(``trainer.rl.loop``), from the model's config and the recipe:

* ``off``: no routes are asked of the engine; the trainer's routers choose (a dense model's only setting).
* ``measure``: the engine returns its routes, the trainer's routers keep their own choice, and every step
  logs how often the two agree (``parity/routing_*``). What replay would fix, without changing the run.
* ``on``: the engine returns its routes and the trainer's forward uses them (``trainer.models.routing_replay``),
  and the routing metrics are logged too. Refused, with the reason, where it cannot hold: a dense model, an
  MoE family replay does not know.
* ``auto`` (default): ``on`` where it can hold, else ``off``.

Every engine returns routes when asked: colocated vLLM (CPU: the project's capture; CUDA: vLLM's own option),
the HF engine, and a ``parityrl serve`` server on CPU (its workers capture them; the trainer fetches them after
each batch), which ``parityrl serve`` then starts without prefix caching. A server on CUDA cannot: ``parityrl
serve`` and the trainer's connection refuse it (``rollout.server_engine.SERVER_ROUTES_ON_CUDA``).
"""
from __future__ import annotations

from typing import Any, Union

from rollout.moe_config import MOE_FAMILIES, is_moe, moe_shape

__all__ = ["MODES", "routing_mode"]

MODES = ("auto", "on", "off", "measure")


def routing_mode(setting: Union[str, bool], config: Any, *, where: str) -> str:
    """"replay", "measure" or "off" for ``parity.routing_replay = setting`` on a model with HF ``config``;
    ``ValueError`` naming ``where`` and the key where the setting cannot hold. A YAML bare on / off arrives
    as true / false."""
    setting = {True: "on", False: "off"}.get(setting, setting) if isinstance(setting, bool) else setting
    if setting not in MODES:
        raise ValueError(f"{where}: parity.routing_replay = {setting!r}: expected one of {list(MODES)}")
    if setting == "off":
        return "off"
    kind = getattr(config, "model_type", "?")
    if moe_shape(config) is None:
        if setting == "auto":
            return "off"
        what = (f"a mixture-of-experts family replay does not support (supported: {sorted(MOE_FAMILIES)})"
                if is_moe(config) else "a dense model: it has no router to replay")
        raise ValueError(f"{where}: parity.routing_replay = {setting!r}: the model ({kind}) is {what}; set "
                         "parity.routing_replay: auto (replays where the model routes) or off")
    return "replay" if setting in ("auto", "on") else "measure"
