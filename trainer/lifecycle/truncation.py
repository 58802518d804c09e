"""A console warning when completions keep hitting ``rollout.max_new_tokens`` (``rollout/frac_truncated``)."""
from __future__ import annotations

from typing import Optional

THRESHOLD = 0.5  # share of the step's completions cut at max_new_tokens
AGAIN_AFTER = 10  # steps: repeated while it persists, not every step


class TruncationWatch:
    def __init__(self, threshold: float = THRESHOLD, again_after: int = AGAIN_AFTER) -> None:
        self.threshold, self.again_after = threshold, again_after
        self._warned_at: Optional[int] = None

    def check(self, step: int, frac: Optional[float], max_new_tokens: int) -> Optional[str]:
        """The warning to print at ``step`` (once when ``frac`` passes the threshold, again every
        ``again_after`` steps while it stays above), else None; below it resets."""
        if frac is None or frac <= self.threshold:
            self._warned_at = None
            return None
        if self._warned_at is not None and step - self._warned_at < self.again_after:
            return None
        self._warned_at = step
        return (f"warning: step {step}: {frac:.0%} of completions were cut at rollout.max_new_tokens = "
                f"{max_new_tokens} (rollout/frac_truncated); raise rollout.max_new_tokens if answers need more")
