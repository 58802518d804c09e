"""The errors of a server client (package docstring, Failures)."""
from __future__ import annotations

from rollout.base import EngineUnavailable


class ServerEngineError(RuntimeError):
    """The vLLM server answered, but with an error or an unusable response. One that cannot be reached
    (not started, died, or not answering in time) raises ``rollout.base.EngineUnavailable`` instead."""


class MalformedAnswer(ServerEngineError, EngineUnavailable):
    """The server answered with a body that is not JSON (truncated, or not from a vLLM server)."""


class UnusableServer(ServerEngineError, EngineUnavailable):
    """At startup the server answered, but it is not one this run can use: not started by `parityrl serve`, other
    settings (dtype, context, model), or an answer of another shape. The run cannot start, as with no server."""
