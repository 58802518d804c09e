"""The small batch the correction tests work by hand (docstring of test_rules.py)."""
import math

import torch

from parity.corrections import CorrectionInputs

TRAIN = torch.tensor([[-0.2, -1.1, -0.7], [-2.0, -1.6, math.inf]])
ROLL = torch.tensor([[-1.1, -1.0, -0.7], [-1.0, -1.0, math.nan]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, math.nan]])
ROW0, ROW1 = [[1, 1, 1], [0, 0, 0]], [[0, 0, 0], [1, 1, 0]]
ALL, NONE = [[1, 1, 1], [1, 1, 0]], [[0, 0, 0], [0, 0, 0]]


def inputs(train=TRAIN, roll=ROLL, mask=MASK, adv=ADV):
    return CorrectionInputs.of(train, roll, mask, adv)
