"""parity/images/* and parity/text/*: the batch's parity apart for the rows with images and the rest, by hand."""
import pytest
import torch

from trainer.distributed.data_parallel import DataParallel
from trainer.vision.parity import image_split_metrics


def test_rows_with_images_and_text_rows_are_measured_apart():
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0], [-0.5, -0.5, -0.5]])
    train = engine + torch.tensor([[0.1, -0.1, 0.0], [0.4, 0.0, 9.0], [0.0, 0.0, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # row 1's last token is padding
    m = image_split_metrics(DataParallel(), train, engine, mask, per_row=[1, 0, 2])
    assert m["parity/images/num_tokens"] == 6 and m["parity/text/num_tokens"] == 2
    assert m["parity/images/mae"] == pytest.approx((0.1 + 0.1 + 0.3) / 6)
    assert m["parity/text/mae"] == pytest.approx(0.4 / 2)  # the padding's 9.0 is not counted
    assert m["parity/images/max_abs"] == pytest.approx(0.3) and m["parity/text/max_abs"] == pytest.approx(0.4)


def test_a_batch_without_text_rows_reports_none_of_them():
    lp = torch.zeros(2, 2)
    m = image_split_metrics(DataParallel(), lp, lp, torch.ones(2, 2), per_row=[1, 1])
    assert m["parity/text/num_tokens"] == 0.0 and "parity/text/mae" not in m and m["parity/images/mae"] == 0.0
