"""The SFT stage: its recipe and its training, below the `parityrl sft` command so that the built-in
model's warm start (trainer.models.builtin) can run it without importing the command."""
