"""Built-in tasks: prompt datasets and their verifiable rewards, addressable by name.

``BUILTIN_DATASETS[name](num_examples, *, seed, split, **kwargs) -> datasets.Dataset``
backs the data source ``builtin:<name>`` (``trainer.data.datasets.load_prompt_dataset``);
``BUILTIN_REWARDS["<task>.<reward>"]`` backs the reward spec
``builtin:<task>.<reward>`` (``trainer.rewards.functions.resolve_reward``).
"""

from __future__ import annotations

from trainer.data.tasks import arithmetic, arithmetic_prefs, arithmetic_tools, shapes

__all__ = ["BUILTIN_DATASETS", "BUILTIN_REWARDS", "DEFAULT_NUM_EXAMPLES", "PROMPT_SOURCES"]

BUILTIN_DATASETS = {
    "arithmetic": arithmetic.arithmetic_dataset,
    # prompt / chosen / rejected pairs for `parityrl train-rm` (not an RL prompt source)
    "arithmetic_preferences": arithmetic_prefs.preference_dataset,
    # two-step problems for tool-using episodes (scored by arithmetic.exact_answer)
    "arithmetic_tools": arithmetic_tools.arithmetic_tools_dataset,
    # counting shapes in an image: a vision-language task (data.image_column: image; scored by arithmetic.exact_answer)
    "shapes": shapes.shapes_dataset,
}

# The built-in datasets an RL recipe can draw prompts from (data.source: builtin:<name>).
PROMPT_SOURCES = ("arithmetic", "arithmetic_tools", "shapes")

BUILTIN_REWARDS = {
    "arithmetic.exact_answer": arithmetic.exact_answer_reward,
    "arithmetic.format": arithmetic.format_reward,
}

# Rows generated for a built-in dataset when the caller does not say how many.
DEFAULT_NUM_EXAMPLES = {"train": 2000, "test": 200}
