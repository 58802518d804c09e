"""A run from its start to its end, below the RL step so that other commands can share it: the checks before
anything loads (``preflight``, ``capacity``), the run directory's state (``run_state``), how a run stops and with
which exit status (``stops``, ``preemption``), and what it shows the user along the way and at the end
(``samples_table``, ``truncation``, ``summary``).
"""
