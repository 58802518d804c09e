"""Third-party console output (trainer/io/third_party_output.py): expected lines go to engine.log, the rest stays."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.io.third_party_output import LineSorter, is_expected

REPO = Path(__file__).resolve().parents[3]

# Lines as the demo prints them (vLLM 0.32 on CPU, torch, transformers, DeepSpeed).
SEEN = [
    "(MainProcess pid=22266) WARNING 11-25 17:45:26 [cpu_worker.py:140] CPU backend doesn't allow to use "
    "`torch.set_num_threads` after the thread binding, skip it.",
    "(MainProcess pid=22266) WARNING 11-25 17:45:21 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD. For "
    "best performance, please follow the section",
    "(MainProcess pid=22266) WARNING 11-25 17:45:19 [arg_utils.py:3005] This model does not officially support "
    "disabling chunked prefill. Disabling this manually may cause the engine to crash or produce incorrect outputs.",
    "[W1125 17:45:21.951678109 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation",
    # on an AVX512-BF16 host (vllm/platforms/cpu.py), and a first run's build of the built-in model
    "(MainProcess pid=19110) WARNING 11-26 12:28:30 [cpu.py:317] Reset SSM cache type to float32 for accelerated "
    "GDN mamba backend 'none'.",
    "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]Writing model shards: 100%|██████████| 1/1",
    # the first build of builtin:smollm2-135m (Transformers' GGUF loader)
    "Converting and de-quantizing GGUF tensors...:   0%|          | 0/272 [00:00<?, ?it/s]\rConverting and "
    "de-quantizing GGUF tensors...: 100%|██████████| 272/272 [00:01<00:00, 155.57it/s]",
    "[2026-11-25 17:45:01,886] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. "
    "If you have GPU or other accelerator, we were unable to detect it.",
    # a vision-language model's run (the tiny Idefics3, LoRA served as an adapter)
    "[transformers] `Idefics3ImageProcessor` requires torchvision (not installed); falling back to "
    "`Idefics3ImageProcessorPil` for backward compatibility. Install torchvision to use the default backend, or "
    "import `Idefics3ImageProcessorPil` directly to silence this warning.",
    "(MainProcess pid=19545) WARNING 11-30 15:16:35 [model_manager.py:496] Regarding Idefics3ForConditionalGeneration, "
    "no matching PunicaWrapper is found; model.vision_model.encoder.layers.0.self_attn.qkv_proj will be ignored.",
    "[transformers] Model config: pad_token_id must be `None` or an integer within the vocabulary (between 0 and "
    "31999), got 128002. This may result in unexpected behavior.",
    # nanobind's report at a vLLM server's exit (format strings in triton/_C/libtriton.so)
    "nanobind: leaked 12 functions!",
    ' - leaked function "get_int_attr"',
    "nanobind: this is likely caused by a reference counting issue in the binding code.",
    "See https://nanobind.readthedocs.io/en/latest/refleaks.html",
]


def test_known_lines_are_expected_and_parityrl_lines_are_not():
    assert all(is_expected(line) for line in SEEN)
    for ours in ["step    1/20  reward 0.283  parity/mae 1.2e-03", "warning: step 3: 66% of completions were cut",
                 "parityrl: error: RuntimeError: boom", "Traceback (most recent call last):",
                 "(MainProcess pid=1) WARNING 11-25 17:45:19 [x.py:1] something new"]:
        assert not is_expected(ours), ours


def test_continuation_lines_follow_their_expected_line():
    lines = ["/v/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated, please use ...",
             '  if hasattr(value, "__dict__"):',
             "(MainProcess pid=9) WARNING 11-25 [base.py:380] Chat template warmup failed",
             "Traceback (most recent call last):",
             '  File "/v/renderers/base.py", line 372, in warmup',
             "    self.render_chat(...)",
             "ValueError: Tokenizer not available when `skip_tokenizer_init=True`",
             "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  1.38it/s]",
             "",
             "step    1/3  reward 0.250",
             "  an indented line of ours after one of ours",
             ""]
    s = LineSorter()
    assert [s.sort(x) for x in lines] == [True] * 9 + [False, False, False]
    # vLLM logs a traceback with its prefix on every line (the server's chat-template warm-up)
    pre = "(APIServer pid=9136) WARNING 11-25 18:24:12 [base.py:380] "
    server = [pre + "Chat template warmup failed", pre + "Traceback (most recent call last):",
              pre + '  File "/v/renderers/base.py", line 372, in warmup',
              pre + "ValueError: Tokenizer not available when `skip_tokenizer_init=True`",
              "(APIServer pid=9136) WARNING 11-25 18:24:14 [serving.py:9] something else",
              'INFO:     127.0.0.1:56730 - "GET /health HTTP/1.1" 200 OK']
    s = LineSorter()
    assert [s.sort(x) for x in server] == [True, True, True, True, False, True]
    # a crash after a progress bar (the model loaded, then the run failed) is the process's own: on the console
    s = LineSorter()
    crash = ["Loading weights: 100%|██████████| 59/59 [00:00<00:00, 4376.25it/s]", "Traceback (most recent call last):",
             '  File "/w/trainer/supervised/sft.py", line 112, in _pairs', "ValueError: ours"]
    assert [s.sort(x) for x in crash] == [True, False, False, False]
    # an exception line outside an expected traceback stays on the console
    s = LineSorter()
    assert [s.sort(x) for x in ["Traceback (most recent call last):", "ValueError: ours"]] == [False, False]


SCRIPT = textwrap.dedent("""
    import logging, os, sys, warnings
    from pathlib import Path
    from trainer.io import third_party_output as t
    t.install(verbose=VERBOSE)
    print("parityrl line one", flush=True)
    logging.basicConfig(stream=sys.stdout)
    logging.getLogger("vllm.v1.worker.cpu_worker").warning(
        "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
    os.write(2, b"[W1125 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation\\n")
    warnings.warn("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
                  FutureWarning)
    sys.stderr.write("an unexpected warning\\n")
    t.attach(Path(sys.argv[1]))
    print("Triton is installed, but doesn't include CPU backend. Disabling Triton.", flush=True)
    print("parityrl line two", flush=True)
    sys.stderr.write("See https://nanobind.readthedocs.io/en/latest/refleaks.html")  # the last line, no newline
""")


def _run(tmp_path, verbose: bool):
    code = SCRIPT.replace("VERBOSE", str(verbose))
    return subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_a_process_console_keeps_its_own_lines_and_the_run_dir_the_rest(tmp_path):
    proc = _run(tmp_path, verbose=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "parityrl line one\nparityrl line two\n"
    assert proc.stderr == "an unexpected warning\n"
    log = (tmp_path / "engine.log").read_text()
    # written before attach (kept in memory) and after it
    for text in ["torch.set_num_threads", "NUMA binding", "reduce_op` is deprecated",
                 "Disabling Triton", "refleaks.html\n"]:
        assert text in log, (text, log)
    assert "parityrl line" not in log and "unexpected" not in log


def test_verbose_shows_everything_and_still_logs(tmp_path):
    proc = _run(tmp_path, verbose=True)
    assert proc.returncode == 0, proc.stderr
    assert "torch.set_num_threads" in proc.stdout and "Disabling Triton" in proc.stdout
    assert "NUMA binding" in proc.stderr and "an unexpected warning" in proc.stderr
    assert "NUMA binding" in (tmp_path / "engine.log").read_text()


def test_shutdown_before_os_exit_delivers_the_last_line(tmp_path):
    """os._exit skips atexit: the stop line of a signal at startup (trainer/lifecycle/preemption.py) would stay in the pipe."""
    code = ("import os, sys\nfrom trainer.io import third_party_output as t\nt.install()\n"
            "print('parityrl: SIGTERM received before the first step', file=sys.stderr, flush=True)\n"
            "t.shutdown()\nos._exit(143)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143 and proc.stderr == "parityrl: SIGTERM received before the first step\n"


@pytest.mark.slow
def test_sft_console_holds_parityrl_lines_and_libraries_log_the_rest(tmp_path):
    """`parityrl sft` as a user runs it: transformers' loading bar and DeepSpeed's CPU note go to libraries.log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([str(Path(sys.executable).with_name("parityrl")), "sft", "recipes/sft_tiny.yaml",
                           "--set", "train.steps=3", "--set", f"output_dir={tmp_path / 'out'}",
                           "--set", f"logging.run_dir={run_dir}", "--set", "logging.wandb.mode=disabled"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines and all(line.startswith(("launch: ", "sft step ", "sft model written to ")) for line in lines), lines
    assert "Loading weights" in (run_dir / "libraries.log").read_text()
