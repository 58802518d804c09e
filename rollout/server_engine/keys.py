"""The recipe keys a server client's errors name, and how its server is started."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerKeys:
    """The recipe keys a server client's errors name, and how its server is started: the student's server
    (``rollout.mode: server``) by default; the teacher's name ``teacher.*`` (trainer/teacher/teacher.py)."""

    url: str = "rollout.server_url"
    timeout: str = "rollout.server_timeout_s"
    connect_timeout: str = "rollout.server_connect_timeout_s"
    start: str = "`parityrl serve <recipe>`"

    def restart_hint(self) -> str:
        return (f"the server process may have died or never started; start it with {self.start} (listening on "
                f"{self.url}) and continue the run with `parityrl train <recipe> --resume`")


ROLLOUT_SERVER = ServerKeys()
