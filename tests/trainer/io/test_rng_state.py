"""Every rank's generators in rng.pt, each rank restoring its own (trainer.io.checkpoint)."""
import random

import torch

from trainer.io.checkpoint import rng_state, set_rng_state


def test_each_rank_restores_its_own_generators_and_old_files_still_load():
    torch.manual_seed(1)
    random.seed(1)
    rank0 = rng_state()
    torch.manual_seed(2)
    random.seed(2)
    rank1 = rng_state()
    expected1 = (torch.rand(3), random.random())
    saved = {"ranks": [rank0, rank1]}
    torch.manual_seed(99)
    set_rng_state(saved, rank=1)
    assert torch.equal(torch.rand(3), expected1[0]) and random.random() == expected1[1]
    set_rng_state(saved, rank=0)
    torch.manual_seed(1)
    reference = torch.rand(3)
    set_rng_state(saved, rank=0)
    assert torch.equal(torch.rand(3), reference)
    # a checkpoint from before (one state, rank 0's) is taken by every rank, as it was
    set_rng_state(rank0, rank=1)
    assert torch.equal(torch.rand(3), reference)
    assert "cuda" not in rng_state()  # CPU here; with CUDA every device's state is added (unrun)
