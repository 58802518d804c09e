"""Environments beside the rewards: multi-turn, tool-using episodes (issue 34).

* ``contract``: what an environment is (``reset(row)``, ``step(message)``) and the checks of what it returns;
* ``tool_calls``: an assistant turn's text parsed into the message ``step`` receives;
* ``tools``: a tool environment from plain Python functions;
* ``arithmetic_tools``: the built-in calculator for the arithmetic task;
* ``loading``: environments and tools named in a recipe, as reward functions are.

The ids of an episode (prompt, sampled turns, observations) are built by ``trainer.sampling.turn_tokens``.
"""
