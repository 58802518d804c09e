"""Bad inputs a new user makes, each with the exit status and the words its one-line refusal must contain.

``test_bad_inputs.py`` runs every case through ``parityrl train`` in-process (refused before ``train()`` is
called) and a few as real subprocesses; ``python tests/trainer/commands/bad_input_corpus.py`` runs every case
as a subprocess against whatever ``PYTHONPATH`` points at and prints the tally the issue asks for:
early+clear (exit 2, one line, no engine started) / late (refused after an engine started) / unclear
(another status, a traceback or several lines) / accepted (exit 0).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# A valid recipe the cases break one thing of; tiny so that an accepted case costs a 1-step HF-engine run.
BASE = """\
name: corpus
model: {path: builtin:tiny}
data: {num_examples: 8}
rollout: {engine: hf, prompts_per_step: 2, max_new_tokens: 4}
algorithm: {group_size: 2}
train: {steps: 1, micro_batch_size: 4}
checkpoint: {every: 0}
parity: {probe_prompts: 0}
logging: {run_dir: "{tmp}/run", wandb: {mode: disabled}}
"""
GOOD_ROWS = "".join(f'{{"prompt": "What is {i} plus 1?", "answer": "{i + 1}"}}\n' for i in range(8))
REWARDS_PY = "def good(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n\nNOT_A_FUNCTION = 3\n"


@dataclass
class Case:
    id: str
    sets: tuple[str, ...] = ()  # --set overrides on BASE
    recipe: str | None = None  # a whole recipe instead of BASE
    files: dict[str, str] = field(default_factory=dict)  # written under {tmp} first
    args: tuple[str, ...] = ()  # extra CLI arguments
    contains: tuple[str, ...] = ()  # words the message must contain ({tmp} expanded)
    status: int = 2
    lines: int = 1  # problems said, one line each (a case that breaks two things hears of both at once)


def _data(name: str) -> str:
    return f"data.source={{tmp}}/{name}"


CASES = [
    # the recipe file itself
    Case("recipe_missing", recipe="<none>", contains=("recipe file not found",)),
    Case("recipe_empty", recipe="", contains=("recipe is empty",)),
    Case("recipe_not_yaml", recipe="model: {path: [unclosed\n", contains=("not valid YAML",)),
    Case("recipe_top_level_list", recipe="- a\n- b\n", contains=("expected a mapping of sections",)),
    Case("unknown_section", sets=("trainer.steps=3",), contains=("unknown key 'trainer'",)),
    Case("unknown_key", sets=("train.stepz=3",),
         contains=("--set train.stepz=3: unknown key 'train.stepz' (did you mean 'train.steps'?)", "steps")),
    Case("wrong_type", sets=("train.steps=ten",), contains=("train.steps = 'ten'", "an integer")),
    Case("group_size_1", sets=("algorithm.group_size=1",), contains=("algorithm.group_size = 1", ">= 2")),
    Case("negative_lr", sets=("train.learning_rate=-1",), contains=("train.learning_rate = -1", "> 0")),
    Case("zero_steps", sets=("train.steps=0",), contains=("train.steps = 0",)),
    Case("top_k_greedy", sets=("rollout.top_k=1",), contains=("rollout.top_k = 1", "greedy decoding")),
    Case("repetition_penalty", sets=("rollout.repetition_penalty=1.1",),
         contains=("rollout.repetition_penalty", "not supported")),
    Case("tau_on_grpo", sets=("algorithm.tau=0.1",), contains=("algorithm.tau", "not an option of grpo", "pmd_mean")),
    Case("unknown_algorithm", sets=("algorithm.name=grpoo",), contains=("algorithm.name = 'grpoo'", "grpo")),
    Case("lora_dropout", sets=("model.lora.dropout=0.1",), contains=("model.lora.dropout = 0.1",)),
    Case("lora_lm_head", sets=("model.lora.target_modules=[q_proj,lm_head]",), contains=("lm_head",)),
    Case("lora_target_absent", sets=("model.lora.target_modules=[q_proj,c_attn]",),
         contains=("model.lora.target_modules", "'c_attn' matches no module", "q_proj")),
    Case("lora_target_not_a_layer", sets=("model.lora.target_modules=[self_attn]",),
         contains=("model.lora.target_modules", "'self_attn' matches", "cannot wrap")),
    Case("model_dir_missing", sets=("model.path={tmp}/nomodel",), contains=("model.path", "no such directory")),
    Case("model_dir_no_config", sets=("model.path={tmp}",), contains=("model.path", "no config.json")),
    Case("model_unknown_builtin", sets=("model.path=builtin:huge",), contains=("unknown built-in model",)),
    Case("context_too_long", sets=("rollout.max_new_tokens=100000",),
         contains=("rollout.max_new_tokens = 100000", "context")),
    Case("fp16_without_float16", sets=("precision.recipe=fp16",), contains=("model.dtype", "float16")),
    Case("fp8_on_hf_engine", sets=("precision.recipe=fp8_rollout",), contains=("rollout.engine", "vllm")),
    Case("exact_on_hf_engine", sets=("precision.recipe=exact",), contains=("rollout.engine = 'hf'", "exact")),
    Case("exact_uncovered_architecture", sets=("precision.recipe=exact", "rollout.engine=vllm", "model.dtype=float32",
                                               "model.path={tmp}/gemma"),
         files={"gemma/config.json": '{"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], '
                '"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, '
                '"head_dim": 32, "intermediate_size": 128, "vocab_size": 256}'},
         contains=("precision.recipe = 'exact'", "model_type 'gemma2'"), lines=2),  # and: the directory has no weights
    Case("mini_batches_not_divisor", sets=("algorithm.mini_batches=3",), contains=("algorithm.mini_batches = 3",)),
    Case("on_violation_value", sets=("parity.on_violation=halt",), contains=("parity.on_violation = 'halt'",)),
    Case("checkpoint_every_negative", sets=("checkpoint.every=-1",), contains=("checkpoint.every = -1",)),
    # --set itself
    Case("set_without_equals", args=("--set", "train.steps"), contains=("expected key=value",)),
    Case("set_empty_key", args=("--set", "=3"), contains=("key before '=' is empty",)),
    Case("set_into_a_value", sets=("train.steps.x=1",), contains=("'steps' holds a value",)),
    # datasets
    Case("data_missing_file", sets=(_data("nope.jsonl"),), contains=("data.source", "no such file")),
    Case("data_unknown_builtin", sets=("data.source=builtin:poetry",), contains=("unknown built-in dataset",)),
    Case("data_no_prompt_column", sets=(_data("q.jsonl"),), files={"q.jsonl": '{"question": "1+1?", "answer": "2"}\n' * 4},
         contains=("data.source", "prompt_column='prompt' is not a column", "question")),
    Case("data_prompt_column_renamed_absent", sets=(_data("d.jsonl"), "data.prompt_column=text"),
         files={"d.jsonl": GOOD_ROWS}, contains=("prompt_column='text' is not a column",)),
    Case("data_no_answer_column", sets=(_data("p.jsonl"),), files={"p.jsonl": '{"prompt": "1+1?"}\n' * 4},
         contains=("answer_column='answer' is not a column",)),
    Case("data_empty_file", sets=(_data("empty.jsonl"),), files={"empty.jsonl": ""}, contains=("is empty",)),
    Case("data_malformed_jsonl_line", sets=(_data("bad.jsonl"),),
         files={"bad.jsonl": GOOD_ROWS + '{"prompt": "x", answer: 3}\n'}, contains=("{tmp}/bad.jsonl:9:",)),
    Case("data_malformed_json", sets=(_data("bad.json"),), files={"bad.json": '[{"prompt": "a", "answer": "1"},\n {"prompt": ]\n'},
         contains=("{tmp}/bad.json:2", "not valid JSON")),
    Case("data_jsonl_not_objects", sets=(_data("list.jsonl"),), files={"list.jsonl": "[1, 2]\n[3, 4]\n"},
         contains=("{tmp}/list.jsonl:1", "JSON object")),
    Case("data_prompt_not_strings", sets=(_data("n.jsonl"),),
         files={"n.jsonl": "".join(f'{{"prompt": {i}, "answer": "1"}}\n' for i in range(4))}, contains=("expected strings",)),
    Case("data_csv", sets=(_data("d.csv"),), files={"d.csv": "prompt,answer\na,1\n"},
         contains=("unsupported dataset file extension",)),
    Case("data_fewer_rows_than_a_step", sets=(_data("d.jsonl"), "rollout.prompts_per_step=16"),
         files={"d.jsonl": GOOD_ROWS}, contains=("rollout.prompts_per_step = 16", "8 rows",
                                                 "(--set rollout.prompts_per_step=8)")),
    # reward modules
    Case("reward_spec_malformed", sets=("reward.functions={r: no_colon}",), contains=("reward.functions.r",)),
    Case("reward_file_missing", sets=("reward.functions={r: '{tmp}/nofile.py:f'}",),
         contains=("reward.functions.r", "does not exist")),
    Case("reward_function_missing", sets=("reward.functions={r: '{tmp}/rewards.py:gooood'}",),
         files={"rewards.py": REWARDS_PY}, contains=("reward.functions.r", "no attribute 'gooood'", "good")),
    Case("reward_not_callable", sets=("reward.functions={r: '{tmp}/rewards.py:NOT_A_FUNCTION'}",),
         files={"rewards.py": REWARDS_PY}, contains=("reward.functions.r", "not callable")),
    Case("reward_module_not_importable", sets=("reward.functions={r: 'no_such_pkg.rewards:f'}",),
         contains=("reward.functions.r", "cannot import module 'no_such_pkg.rewards'")),
    Case("reward_file_raises_on_import", sets=("reward.functions={r: '{tmp}/boom.py:f'}",),
         files={"boom.py": "raise RuntimeError('boom at import')\n"}, contains=("reward.functions.r", "boom at import")),
    Case("reward_wrong_signature", sets=("reward.functions={r: '{tmp}/one.py:f'}",),
         files={"one.py": "def f(completions):\n    return [0.0] * len(completions)\n"},
         contains=("reward.functions.r", "f(prompts, completions, **columns)")),
    Case("reward_weight_unknown_name", sets=("reward.weights={nope: 1.0}",), contains=("reward.weights.nope",)),
    Case("reward_unknown_builtin", sets=("reward.functions={r: 'builtin:arithmetic.nope'}",),
         contains=("reward.functions.r", "unknown builtin reward")),
    # paths of the run
    Case("run_dir_is_a_file", sets=("logging.run_dir={tmp}/afile",), files={"afile": "x"},
         contains=("logging.run_dir", "exists and is not a directory")),
    Case("run_dir_under_a_file", sets=("logging.run_dir={tmp}/afile/run",), files={"afile": "x"},
         contains=("logging.run_dir", "is a file")),
    Case("run_dir_bad_placeholder", sets=("logging.run_dir=runs/{nme}",), contains=("logging.run_dir",)),
]


def materialise(case: Case, tmp: Path) -> list[str]:
    """Write the case's files under ``tmp``; the ``parityrl train`` arguments."""
    for name, text in case.files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    recipe = tmp / "recipe.yaml"
    if case.recipe != "<none>":
        recipe.write_text((BASE if case.recipe is None else case.recipe).replace("{tmp}", str(tmp)))
    argv = ["train", str(recipe)]
    for s in case.sets:
        argv += ["--set", s.replace("{tmp}", str(tmp))]
    return argv + list(case.args)


def expected_words(case: Case, tmp: Path) -> list[str]:
    return [w.replace("{tmp}", str(tmp)) for w in case.contains]


# Run in the subprocess: marks (in a file) that the loop asked for an engine, then runs the CLI. The loop
# takes make_engine by name when it is imported, so the patch precedes that import.
_MARK_ENGINES = """
import os, sys
import trainer.sampling.engines as engines
make_engine = engines.make_engine
def marked(*a, **k):
    open(os.environ["CORPUS_ENGINE_MARK"], "w").close()
    return make_engine(*a, **k)
engines.make_engine = marked
from trainer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def classify(case: Case, tmp: Path, timeout: float = 900) -> tuple[str, str]:
    """(tally bucket, the last stderr line) of one case run as a real subprocess."""
    argv = materialise(case, tmp)
    mark = tmp / "engine_started"
    env = {**os.environ, "CORPUS_ENGINE_MARK": str(mark), "WANDB_MODE": "disabled"}
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _MARK_ENGINES, *argv], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # e.g. an empty recipe training 40 steps on the defaults
        return ("accepted" if mark.exists() else "unclear"), f"still running after {timeout:.0f}s"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if proc.returncode == 0:
        return "accepted", f"{time.perf_counter() - t:.0f}s"
    if mark.exists():
        return "late", last
    messages = [ln for ln in lines if ln.startswith("parityrl")]
    # Clear: status 2, no traceback, one parityrl line naming the case's first word (its key, mostly). The
    # test asserts every word; the tally also judges other implementations, whose wording differs.
    clear = (proc.returncode == case.status == 2 and "Traceback" not in proc.stderr and len(messages) == case.lines
             and expected_words(case, tmp)[0] in messages[0])
    return ("early+clear" if clear else "unclear"), last


def main() -> int:
    import tempfile

    tally: dict[str, int] = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            bucket, last = classify(case, Path(d), timeout=float(os.environ.get("CORPUS_TIMEOUT_S", 300)))
        tally[bucket] = tally.get(bucket, 0) + 1
        print(f"{bucket:12s} {case.id:34s} {last[:150]}", flush=True)
    print(f"{len(CASES)} cases: " + ", ".join(f"{k} {tally.get(k, 0)}" for k in ("early+clear", "late", "unclear",
                                                                               "accepted")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
