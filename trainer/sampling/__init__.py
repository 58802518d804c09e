"""How a step's batch is drawn: the sampling round (``sampler``) and what it hands the step (``drawn``), multi-turn
episodes (``episode_sampler`` scores and measures them, ``episodes`` runs them batched by turn, ``turn_tokens``
makes a reply's ids from the chat template), DAPO's dynamic sampling (``dynamic_sampling``), the one-step-off
prefetch (``async_prefetch``), and the recipe's engine with its weight sync (``engines``: the one place the trainer
constructs an engine of ``rollout/``).
"""
