"""The tools recipe lets the model read every reply the calculator can give: its results and its error messages
(an error cut at env.max_observation_tokens ends the episode as truncated, and the model never sees the error it
could recover from)."""
from pathlib import Path

from trainer.environments.loading import resolve_tools
from trainer.environments.tools import ToolEnvironment
from trainer.lifecycle.preflight import load_recipe
from trainer.models.policy import load_tokenizer

REPO = Path(__file__).resolve().parents[3]

CALLS = [("calculate", {"expression": "3 + 4 * 2"}), ("calculate", {"expression": "12 / (3 - 3)"}),
         ("calculate", {"expression": "twelve plus 3"}), ("calculate", {"expression": "1+" * 200 + "1"}),
         ("calc", {"x": 1}), ("calculate", {"expr": "1+1"})]


def test_every_calculator_reply_fits_the_recipes_observation_budget(tiny_model_dir):
    cfg = load_recipe(REPO / "recipes" / "grpo_tools_tiny.yaml", [], check_paths=False)
    tok = load_tokenizer(tiny_model_dir)  # builtin:tiny-tools shares builtin:tiny's tokenizer
    env = ToolEnvironment(resolve_tools(cfg.env.tools), max_turns=3, timeout_s=5)
    lengths = {}
    for name, args in CALLS:
        env.reset({"prompt": "x"})
        (reply,), _, _ = env.step({"role": "assistant", "content": "",
                                    "tool_calls": [{"function": {"name": name, "arguments": args}}]})
        lengths[reply["content"][:40]] = len(tok(reply["content"], add_special_tokens=False)["input_ids"])
    assert max(lengths.values()) > 40  # the errors are long: the budget must be set for them, not for results
    assert max(lengths.values()) <= cfg.env.max_observation_tokens, lengths
