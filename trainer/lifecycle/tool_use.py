"""A console warning when no episode of several steps in a row called a tool (``episode/tool_calls``): the model is
not using what it was offered (a tool missing from the rendered prompt, a call format the parser does not read, or a
policy that has not learnt to call), and reward and loss can stay at 0 without anything else saying so."""
from __future__ import annotations

from typing import Optional

STEPS = 3  # steps in a row without a single call before the warning
AGAIN_AFTER = 10  # steps: repeated while it persists


class ToolUseWatch:
    def __init__(self, steps: int = STEPS, again_after: int = AGAIN_AFTER) -> None:
        self.steps, self.again_after = steps, again_after
        self._quiet = 0
        self._warned_at: Optional[int] = None

    def check(self, step: int, tool_calls: Optional[float]) -> Optional[str]:
        """The warning to print at ``step``, else None. ``tool_calls``: the step's mean calls per episode (None: not
        a run of tool episodes)."""
        if tool_calls is None:
            return None
        if tool_calls > 0:
            self._quiet, self._warned_at = 0, None
            return None
        self._quiet += 1
        if self._quiet < self.steps or (self._warned_at is not None and step - self._warned_at < self.again_after):
            return None
        self._warned_at = step
        return (f"warning: step {step}: no episode called a tool for {self._quiet} steps (episode/tool_calls 0); "
                "check that the first prompt printed at the start offers the tools, and that the model's calls are "
                "in the format the chat template's parser reads (docs/episodes.md)")
