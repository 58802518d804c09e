"""`parityrl sft`: resolve the model, refuse to replace an output by accident, run the SFT stage (trainer.sft)."""
from __future__ import annotations

from pathlib import Path

from trainer.io.outputs import refuse_existing_output
from trainer.models.builtin import resolve_model_path
from trainer.sft.fit import fit_sft
from trainer.sft.recipe import SFTConfig


def run_sft(cfg: SFTConfig, *, overwrite: bool = False, resume: bool = False) -> Path:
    """Train and write the model to ``cfg.out_path``; returns that path.

    An existing non-empty ``output_dir`` is refused before anything loads (a previous
    model is never replaced by accident, as ``train-rm`` and ``merge`` do); with
    ``overwrite`` it is replaced, atomically, once the new model is complete. ``resume``
    continues from the newest checkpoint under ``logging.run_dir`` (``train.save_every``).
    """
    if not overwrite:
        refuse_existing_output(cfg.out_path, "output_dir")
    return fit_sft(cfg, resolve_model_path(cfg.model.path), resume=resume)
