"""SFT and train-rm print their first step at once, then every print_every-th (trainer/supervised/hf_trainer.py)."""
from types import SimpleNamespace

from trainer.supervised.hf_trainer import StageLogger


class _Logger:
    def __init__(self):
        self.rows = []

    def log(self, step, row, echo=True):
        self.rows.append(step)


def test_first_step_then_every_print_every(capsys):
    logger = _Logger()
    stage = StageLogger(logger, "sft", print_every=20)
    for step in range(1, 42):
        state = SimpleNamespace(is_world_process_zero=True, global_step=step, max_steps=41)
        stage.on_log(None, state, None, logs={"loss": 1.0, "learning_rate": 1e-3})
    printed = [int(line.split()[2].split("/")[0]) for line in capsys.readouterr().out.splitlines()]
    assert printed == [1, 20, 40, 41]
    assert logger.rows == list(range(1, 42))


def test_a_resumed_stage_prints_its_first_step_too(capsys):
    stage = StageLogger(_Logger(), "train-rm", print_every=20)
    stage.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=31, max_steps=100), None,
                 logs={"loss": 0.5})
    assert capsys.readouterr().out.startswith("train-rm step   31/100  loss 0.5000")
