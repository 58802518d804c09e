"""One RL step: the loop and its phases (``loop``), what a run holds (``run``), the update passes (``update``), the
policy under training (``learner``), PPO's critic targets (``critic``) and value head (``value_head``).

A step draws its batch through ``trainer.sampling``, measures it through ``trainer.measurement``, and lives inside
the run's lifecycle (``trainer.lifecycle``); docs/architecture.md follows one step through the rooms.
"""
