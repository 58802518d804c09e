"""The console keeps parityrl's lines; the expected output of vLLM, torch, transformers and DeepSpeed goes to
the run directory's ``engine.log``.

Why at the file-descriptor level: that output arrives by four routes -- Python ``logging`` (vLLM's handler
writes to stdout), ``warnings`` (FutureWarnings), plain ``print`` and C++ writes to fd 2 (torch's
``[W... utils.cpp]`` lines, nanobind's leak report) -- and only a pipe behind fds 1 and 2 sees all four,
including those of child processes that inherit them (``parityrl serve``'s vLLM server).
A reader thread per stream sorts lines: one that matches ``EXPECTED`` (and its continuation: the
indented source line of a warning, a traceback) is written to ``engine.log`` only; every other line
reaches the console unchanged, so an unexpected warning or error is never hidden. ``verbose``
(``parityrl train --verbose``) shows everything and still logs the expected lines.

Until the run directory is claimed (``attach``) the expected lines wait in memory: a refused start
creates nothing. A process that ends with ``os._exit`` calls ``shutdown`` first (atexit does not run).
Not captured: what a process writes after ``close`` (interpreter finalization), and lines still in the
pipe if the process is killed by a signal it cannot handle (SIGKILL). Side effect:
stdout/stderr are pipes, not terminals, so libraries that colour a terminal's output do not.
"""
from __future__ import annotations

import atexit
import os
import re
import select
import sys
import threading
from pathlib import Path
from typing import Optional

from trainer.io.write_failure import writing_at_start

__all__ = ["EXPECTED", "ConsoleFilter", "LineSorter", "attach", "install", "is_expected", "shutdown"]

# (pattern, why it is expected). Searched in each line; keep them specific to one message.
EXPECTED: tuple[tuple[str, str], ...] = (
    # vLLM's CPU backend (vllm/v1/worker/cpu_worker.py, vllm/platforms/cpu.py)
    (r"CPU backend doesn't allow to use `torch.set_num_threads`", "vLLM binds its OpenMP threads once per worker"),
    (r"(libtcmalloc|libiomp) is not found in LD_PRELOAD", "a faster allocator vLLM suggests; optional"),
    (r"Triton is not installed\. triton-cpu is expected", "no Triton CPU backend: vLLM uses its native kernels"),
    (r"Triton is installed, but doesn't include CPU backend", "as above, from torch/DeepSpeed"),
    (r"Model Runner V2 requires Triton", "vLLM falls back to its V1 model runner"),
    (r"Failed to create oneDNN linear, fallback to torch linear",
     "no oneDNN BF16 matmul on a CPU without AVX512-BF16/AMX: vLLM uses torch's"),
    (r"NUMA binding: Using MEMBIND policy", "torch's note on vLLM's CPU memory binding"),
    # vLLM engine arguments parityrl sets on purpose (rollout/vllm_engine.py says why)
    (r"does not officially support disabling chunked prefill", "chunked prefill off: seeded CPU generators"),
    (r"Enforce eager set, disabling torch\.compile", "rollout.enforce_eager: fast start"),
    (r"Inductor compilation was disabled by user settings", "follows from enforce_eager"),
    (r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING",
     "in-process engine; the trainer's RNG is preserved around it (rollout/vllm_engine.py)"),
    (r"Using None for EOS token id because tokenizer is not initialized",
     "token ids in and out; EOS ids are passed as stop_token_ids"),
    (r"Chat template warmup failed", "no tokenizer in the engine (skip_tokenizer_init)"),
    (r"Kernel vllm\.\S+ is already registered\. Overwriting",
     "a second engine in one process (parityrl doctor's precision recipes) registers vLLM's kernels again"),
    (r"\[layerwise\.py:\d+\] (RotaryEmbedding|ParallelLMHead): Failed to load weights",
     "vLLM's in-place reload from the model's files (the doctor's prefix-cache check restores the weights so): "
     "rotary embeddings hold no weights, a tied lm_head shares embed_tokens'"),
    # vision-language models (docs/vision-language.md)
    (r"`Idefics3ImageProcessor` requires torchvision \(not installed\); falling back to `Idefics3ImageProcessorPil`",
     "vLLM looks the image processor up by its default class; the model's processor_config.json names the Pil one, "
     "which both sides run (mm/inputs_equal checks the pixels every step)"),
    (r"no matching PunicaWrapper is found; model\.vision_model\.",
     "vLLM's LoRA offers the vision tower's layers of the adapter's leaf names and skips them; the adapter holds the "
     "language model's layers only"),
    (r"Model config: pad_token_id must be `None` or an integer within the vocabulary \(between 0 and 31999\), got "
     r"128002",
     "Transformers validates a default-built Idefics3 config (its default text config: 32,000 ids, pad 128,002) at "
     "every Idefics3 load; the model's own config holds its pad id"),
    (r"Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
     "vLLM's CPU worker sets it for itself (cpu_worker.py); the next engine in the process sees it"),
    (r"SECURITY WARNING: Development endpoints are enabled", "server mode's weight-sync routes (docs/server-mode.md)"),
    (r"LoRA dynamic loading & unloading is enabled in the API server",
     "server mode's adapter routes, for a recipe that serves its LoRA adapter (docs/server-mode.md)"),
    (r"(Loaded new|Removed) LoRA adapter: name 'parityrl-", "each adapter sync in server mode loads a new version"),
    (r"The chat template requires system-first ordering, so inline system messages",
     "about vLLM's /v1/messages route, which parityrl does not use"),
    (r"Found ulimit of \d+ and failed to automatically increase", "the machine's open-file limit (the tests serve with 20000)"),
    (r'^INFO:\s+\S+ - "(GET|POST) /\S* HTTP/1\.[01]" \d+', "the server's access log: one line per request"),
    (r"\[shutdown\] (Process manager: )?force killing (remaining|sub process)",
     "a stopping server ends its engine processes"),
    (r"Loading (safetensors checkpoint shards|weights):", "progress bars of model loading"),
    (r"Writing model shards:", "Transformers' bar while a built-in model is written into the cache (once)"),
    (r"Converting and de-quantizing GGUF tensors\.\.\.:",
     "Transformers' bar while builtin:smollm2-135m is dequantized from its GGUF file (once; trainer/builtin/pretrained.py)"),
    (r"Reset SSM cache type to float32 for accelerated GDN mamba backend",
     "vLLM's CPU platform on AVX512-BF16 hosts: a cache setting for Mamba/GDN layers, which the model does not use"),
    # torch / DeepSpeed / nanobind
    (r"`torch\.distributed\.reduce_op` is deprecated", "vLLM's Triton shim touches a deprecated torch name"),
    (r"Setting accelerator to CPU\. If you have GPU", "DeepSpeed on a machine without a GPU"),
    # nanobind (Triton's extensions) at interpreter exit: objects still alive then; harmless at exit
    (r"^nanobind: leaked \d+ (instances|types|functions|keep_alive records)!|^ - leaked (instance|type|function) |"
     r"^nanobind: this is likely caused by a reference counting issue|^ - \.\.\. skipped remainder|"
     r"^See https://nanobind\.readthedocs\.io/en/latest/refleaks\.html",
     "objects alive at interpreter exit in a nanobind extension (Triton's): harmless at exit"),
)
_PATTERNS = [re.compile(p) for p, _ in EXPECTED]
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Warning)\b")
# vLLM's log prefix, repeated on every line of a multi-line record (a traceback logged with exc_info):
# "(APIServer pid=9136) WARNING 11-25 18:24:12 [base.py:380] ..."
_VLLM_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d [\d:]+ \[[^\]]+\] ")
_BUFFER_LINES = 20_000  # kept in memory before the run directory exists


# tqdm's and vLLM's progress bars ("59/59 [00:00<00:00, ...]")
_PROGRESS_BAR = re.compile(r"\d+/\d+ \[\d+:\d\d")


def is_expected(line: str) -> bool:
    return any(p.search(line) for p in _PATTERNS)


class LineSorter:
    """Sorts one stream's lines into (console, log): an expected line and its continuation lines
    (indented or blank, a ``Traceback``, its final ``SomeError: ...`` line) go to the log."""

    def __init__(self) -> None:
        self._in_expected = False
        self._in_traceback = False
        self._bar = False
        self._prefix = ""  # vLLM's prefix of the last expected line (its continuation lines repeat it)

    def sort(self, line: str) -> bool:
        """True when ``line`` belongs in the log (expected), False when it belongs on the console."""
        bare = line.rstrip("\r\n")
        if is_expected(bare):
            self._in_expected, self._in_traceback = True, False
            self._bar = bool(_PROGRESS_BAR.search(bare))
            m = _VLLM_PREFIX.match(bare)
            self._prefix = m.group(0) if m else ""
            return True
        if self._in_expected and self._prefix and bare.startswith(self._prefix.split("] ")[0]):
            return True  # the same record's next line: same process, level, time and source line
        if self._in_expected:
            # a logged record's traceback is its own; one after a progress bar is the process's crash
            if bare.startswith("Traceback (most recent call last)") and not self._bar:
                self._in_traceback = True
                return True
            if bare[:1] in (" ", "\t") or not bare.strip():  # indented, or the blank line a progress bar ends with
                return True
            if self._in_traceback and _EXCEPTION_LINE.match(bare):
                self._in_traceback = False
                return True
        self._in_expected = self._in_traceback = False
        return False


class ConsoleFilter:
    """Pipes behind fds 1 and 2; see the module docstring."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self._lock = threading.Lock()
        self._log: Optional[object] = None
        self._pending: list[str] = []
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []

    def install(self) -> "ConsoleFilter":
        for fd in (1, 2):
            (sys.stdout if fd == 1 else sys.stderr).flush()
            self._saved[fd] = os.dup(fd)
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            t = threading.Thread(target=self._pump, args=(r, self._saved[fd]), daemon=True,
                                 name=f"parityrl-console-{fd}")
            t.start()
            self._threads.append(t)
        atexit.register(self.close)
        return self

    def attach(self, path: Path) -> None:
        """Write the expected lines from now on (and those seen so far) to ``path``."""
        with self._lock:
            if self._log is not None:
                return
            log = open(path, "a", encoding="utf-8", errors="replace")
            try:
                log.writelines(self._pending)
                log.flush()
            except OSError:
                # a full disk: the lines stay pending and the readers keep buffering instead of writing to a
                # file that fails every line (the start then stops with the failure's own sentence)
                try:
                    log.close()
                except OSError:
                    pass
                raise
            self._log = log
            self._pending.clear()

    def close(self) -> None:
        """Give fds 1 and 2 back and drain the pipes (their readers see EOF once no process holds them)."""
        if not self._saved:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
        for t in self._threads:
            t.join(timeout=2.0)
        for saved in self._saved.values():
            os.close(saved)
        self._saved.clear()
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None

    def _keep(self, line: str) -> None:
        with self._lock:
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
            elif len(self._pending) < _BUFFER_LINES:
                self._pending.append(line)

    def _pump(self, r: int, out: int) -> None:
        sorter, partial = LineSorter(), b""
        try:
            while True:
                # A line without its newline (a prompt, a progress bar) is passed on after 0.2 s, not held.
                ready, _, _ = select.select([r], [], [], 0.2)
                if not ready:
                    if partial and not is_expected(partial.decode("utf-8", "replace")):
                        _write_all(out, partial)
                        partial = b""
                    continue
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                *lines, partial = (partial + chunk).split(b"\n")
                for raw in lines:
                    text = raw.decode("utf-8", "replace") + "\n"
                    expected = sorter.sort(text)
                    if expected:
                        self._keep(text)
                    if self.verbose or not expected:
                        _write_all(out, raw + b"\n")
            if partial:  # the stream's last line, without its newline
                text = partial.decode("utf-8", "replace")
                expected = sorter.sort(text)
                if expected:
                    self._keep(text + "\n")
                if self.verbose or not expected:
                    _write_all(out, partial)
        finally:
            os.close(r)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


_ACTIVE: Optional[ConsoleFilter] = None


def install(verbose: bool = False) -> ConsoleFilter:
    """Start filtering this process's console (once; the command line calls it before vLLM is imported)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = ConsoleFilter(verbose=verbose).install()
    return _ACTIVE


def shutdown() -> None:
    """Forward what is in the pipes and give the console back: before ``os._exit`` (no atexit runs then)."""
    if _ACTIVE is not None:
        _ACTIVE.close()


def attach(run_dir: Path, rank: int = 0, name: str = "engine") -> Optional[Path]:
    """Send the expected lines to ``run_dir/<name>.log`` (``<name>.rank<r>.log`` on rank r > 0), if filtering
    is on in this process; returns the file or None."""
    if _ACTIVE is None:
        return None
    path = Path(run_dir) / (f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log")
    with writing_at_start(run_dir, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        _ACTIVE.attach(path)
    return path
