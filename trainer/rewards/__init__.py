"""Reward sources of the RL loop: reward functions, and reward models scoring prompt + completion."""
