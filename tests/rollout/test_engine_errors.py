"""rollout.base.one_line: an engine's refusal as one line that still says why."""
import pydantic
import pytest

from rollout.base import one_line


class _Config(pydantic.BaseModel):
    max_model_len: int

    @pydantic.field_validator("max_model_len")
    @classmethod
    def _fits(cls, v: int) -> int:
        if v > 256:
            raise ValueError(f"max_model_len {v} is larger than the model's 256 positions")
        return v


def test_a_pydantic_refusal_keeps_its_reason_not_the_docs_link():
    with pytest.raises(pydantic.ValidationError) as info:
        _Config(max_model_len=300)
    assert "For further information visit" in str(info.value)  # what vLLM's config errors end with
    line = one_line(info.value)
    assert line.startswith("ValidationError: ") and "larger than the model's 256 positions" in line
    assert "errors.pydantic.dev" not in line


def test_other_errors_give_their_last_line():
    assert one_line(RuntimeError("Traceback noise\nthe reason")) == "RuntimeError: the reason"
    assert one_line(AssertionError()) == "AssertionError"
