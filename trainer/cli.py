"""`parityrl` command line: train, sft, train-rm, merge, compare, doctor, serve.

    parityrl train recipes/grpo_tiny.yaml [--set train.steps=5 ...] [--resume]
    parityrl sft recipes/sft_tiny.yaml [--set ...] [--resume] [--overwrite]
    parityrl train-rm recipes/rm_tiny.yaml [--set ...] [--resume]
    torchrun --nproc_per_node 2 -m trainer.cli sft recipes/sft_lora_tiny.yaml   (DDP; transformers.Trainer)
    parityrl merge <base_dir> <adapter_dir> --out <dir> [--dtype auto]
    parityrl compare builtin:tiny prompts.txt --out reports/cmp [--engine hf] [--self-check]
    parityrl serve recipes/grpo_tiny.yaml [--tensor-parallel-size 2] [--dry-run]   (rollout.mode: server)
    accelerate launch -m trainer.train recipes/grpo_tiny.yaml [--set ...]

Recipes are validated before any model or engine starts; a bad recipe exits
with status 2 and one line naming the file, key, value and expectation; so do
bad inputs to `compare` (missing file, wrong column, empty prompts, an existing
non-empty --out without --overwrite).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import sys

import yaml

from trainer.config import RecipeError, to_dict
from trainer.io import third_party_output
from trainer.precision import DEFAULT_RECIPE, compare_choices

VERBOSE_HELP = ("show vLLM's, torch's and transformers' expected warnings on the console too (they always go to "
                "the run directory's engine.log)")
STAGE_VERBOSE_HELP = VERBOSE_HELP.replace("vLLM's, ", "").replace("engine.log", "libraries.log")


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="path to a YAML recipe (see recipes/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set train.steps=5 (repeatable; values parsed as YAML)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved recipe (defaults included, overrides applied) as YAML and exit")


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("parityrl")
    except PackageNotFoundError:  # a checkout on PYTHONPATH without an install
        return "unknown (not installed)"


def print_config(cfg) -> int:
    """The resolved recipe as YAML (what the run records as recipe.yaml), for any of the recipe commands."""
    data = json.loads(json.dumps(to_dict(cfg), default=str))  # paths and the like as strings
    print(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parityrl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"parityrl {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="RL training (GRPO, PPO, PMD-mean, ...) with vLLM rollouts and per-step parity metrics")
    _add_recipe_args(t)
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run directory")
    t.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error (or PARITYRL_DEBUG=1)")
    t.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    s = sub.add_parser("sft", help="supervised fine-tuning (the warm start before RL)")
    _add_recipe_args(s)
    s.add_argument("--overwrite", action="store_true",
                   help="replace an existing output_dir (swapped in whole once the new model is written)")
    s.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint under logging.run_dir (written every train.save_every steps)")
    s.add_argument("--verbose", action="store_true", help=STAGE_VERBOSE_HELP)
    r = sub.add_parser("train-rm", help="train a reward model on prompt/chosen/rejected pairs (pairwise loss, LoRA)")
    _add_recipe_args(r)
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint under logging.run_dir (written every train.save_every steps)")
    r.add_argument("--verbose", action="store_true", help=STAGE_VERBOSE_HELP)
    m = sub.add_parser("merge", help="fold a LoRA adapter into its base: a plain HF model directory",
                       description="Merge a PEFT LoRA adapter (parityrl sft with output_format: adapter, or an RL "
                                   "checkpoint's adapter/) into its base model and save model + tokenizer to --out.")
    m.add_argument("base", help="the base model: a local HF directory or builtin:tiny / builtin:tiny-base")
    m.add_argument("adapter", help="the PEFT adapter directory (with adapter_config.json)")
    m.add_argument("--out", required=True, help="output directory (must be new or empty)")
    m.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="dtype of the saved weights (auto: the base's); the merge itself runs in float32")
    _add_compare_args(sub.add_parser(
        "compare", help="engine vs trainer log-probs of the same sampled tokens: a report directory",
        description="Generate with the engine, score the same tokens with the trainer (HF), and write "
                    "summary.json, tokens.jsonl, samples.jsonl, report.xlsx and plots to --out."))
    _add_doctor_args(sub.add_parser(
        "doctor", help="where engine and trainer diverge: a battery of checks with PASS / WARN / FAIL (docs/doctor.md)",
        description="Start the recipe's engine and trainer on its model, precision and data, run the checks on the "
                    "same token ids and print one table; doctor.json and plots go to --out. Exit status 0: every "
                    "check passed or warned; 2: the input was refused; 4: the engine cannot load the model; 8: a "
                    "check failed."))
    _add_serve_args(sub.add_parser(
        "serve", help="start the vLLM server that rollout.mode: server trains against (trainer/commands/serve.py)",
        description="Start a vLLM server for the recipe's model on rollout.server_url, with processed log-probs, "
                    "token-in/token-out generation and the weight-transfer backend enabled."))
    return parser


def _add_doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="a YAML recipe (default with --model: recipes/grpo_tiny.yaml's settings)")
    p.add_argument("--model", help="examine this model (a local HF directory or builtin:...) instead of the recipe's")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (repeatable)")
    p.add_argument("--only", action="append", metavar="CHECK",
                   help="run only this check (repeatable); the names are the table's first column")
    p.add_argument("--out", default="doctor-report", help="the report folder (new or empty; default doctor-report)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP.replace("the run directory's", "the report's"))


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    _add_recipe_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor parallel size (default 1)")
    p.add_argument("--transfer-backend", choices=["auto", "parityrl_file", "nccl"], default="auto",
                   help="weight transfer: parityrl_file (CPU, same host), nccl (CUDA); auto picks by device")
    p.add_argument("--dry-run", action="store_true", help="print the server command and exit")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP.replace("engine.log", "server.log"))


_BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """'268435456', '256MiB', '1GiB', '512MB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a byte count such as 268435456, 256MiB or 1GiB")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def _add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="local Hugging Face model directory, or builtin:tiny")
    p.add_argument("prompts", help="prompt file: .txt (one prompt per line) or .jsonl/.json/.parquet with a prompt column")
    p.add_argument("--out", required=True, help="report directory (must be new or empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace the report files in an existing --out")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP.replace("the run directory's", "the report's"))
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="generation engine (default vllm)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; the trainer scores with it too")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling (1.0 = off); the trainer scores over the set the engine kept")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off); scored over the kept set as --top-p")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0 = off); scored as --top-p")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("-n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="trainer and engine dtype")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--prompt-column", default="prompt", help="prompt column of a .jsonl/.json/.parquet file")
    p.add_argument("--image-column", default=None, metavar="COLUMN",
                   help="a vision-language model's prompts with their images from this column (as data.image_column): "
                        "both sides run them, their inputs checked identical first (docs/compare.md)")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                   help="render prompts with the tokenizer's chat template (auto: if it has one)")
    p.add_argument("--system-prompt", default=None,
                   help="the chat template's system message ('' = none; default: the template's own)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="refuse prompts longer than this")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="engine context (default: longest prompt + max new tokens)")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=None, help="vLLM CPU KV cache, e.g. 256MiB")
    p.add_argument("--batch-size", type=int, default=16, help="samples per trainer scoring micro-batch")
    p.add_argument("--precision", choices=compare_choices(), default=DEFAULT_RECIPE,
                   help="precision recipe of both sides (--dtype must be one it runs in; docs/precision.md)")
    p.add_argument("--topk", type=int, default=0,
                   help="also compare the engine's k most likely tokens per position: parity/topk_kl (0 = off)")
    p.add_argument("--self-check", action="store_true",
                   help="score the engine side with the trainer too: every error metric must be exactly 0 "
                        "(validates the report pipeline); exit status 1 if not")
    p.add_argument("--adapter", default=None, metavar="PATH",
                   help="a run's LoRA adapter (a checkpoint folder or its adapter/): parity with the engine serving "
                        "it and with the merged weights, side by side (docs/compare.md)")


def run_train(argv: list[str] | None = None, prog: str = "parityrl train") -> int:
    p = argparse.ArgumentParser(prog=prog)
    _add_recipe_args(p)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = p.parse_args(argv)
    args.own_console = argv is None
    # a launcher's own options are not known to the processes it started: the hint keeps them as a placeholder
    args.prog = f"<your launch command> -m {prog}" if prog == "trainer.train" else prog
    return _train(args)


def invoked_as(argv0: str) -> str:
    """How to call this program again from the same shell: ``parityrl`` when that is on the PATH and is this
    program, else the path it was called by (``.venv/bin/parityrl``), or ``python -m trainer``."""
    if os.path.basename(argv0) == "parityrl":
        found = shutil.which("parityrl")
        return "parityrl" if found and os.path.realpath(found) == os.path.realpath(argv0) else shlex.quote(argv0)
    python = "python" if (shutil.which("python") and os.path.realpath(shutil.which("python"))
                          == os.path.realpath(sys.executable)) else sys.executable
    return f"{shlex.quote(python)} -m trainer"


def _train(args) -> int:
    if args.own_console and not args.print_config:
        # before vLLM is imported: its expected warnings go to the run's engine.log (trainer/io/third_party_output.py)
        third_party_output.install(verbose=args.verbose)
    # late: each subcommand loads its own stack when it runs (train's pulls in vLLM, seconds), so `parityrl
    # --help`, `--version` and a refused recipe answer at once
    from trainer.io.run_lock import release_all
    from trainer.lifecycle.preemption import StartupStop, end_startup

    # Ctrl-C / SIGTERM from here to the first step: one line, at once (trainer/lifecycle/preemption.py); it ends the
    # process, so only for the process's own command line (as the console filter above).
    # cleanup before os._exit: the lock, then the console filter's pipes (the stop line must reach the console)
    startup = None
    if args.own_console:
        startup = StartupStop(cleanup=lambda: (release_all(), third_party_output.shutdown()),
                              announce=os.environ.get("RANK", "0") == "0").install()
    try:
        from trainer.commands.train import resume_command, run_train_command  # late: as above

        prog = getattr(args, "prog", None) or f"{invoked_as(sys.argv[0]) if args.own_console else 'parityrl'} train"
        if startup is not None and args.resume:  # a stop before the first step leaves the checkpoints as they were
            startup.resume_command = resume_command(args.recipe, args.overrides, prog)
        if getattr(args, "print_config", False):
            from trainer.lifecycle.preflight import check_before_loading  # late: as above

            # what can be checked without the model (its files, layers and memory are checked when training starts)
            return _printed(lambda: check_before_loading(args.recipe, args.overrides, model=False),
                            "the recipe's checks passed (those that need no model: its files, layers and memory are "
                            "checked when training starts)")

        return run_train_command(args.recipe, args.overrides, resume=args.resume, debug=args.debug, prog=prog)
    finally:
        end_startup()


def _sft(args) -> int:
    if args.own_console and not args.print_config:  # before torch loads: its expected lines -> libraries.log
        third_party_output.install(verbose=args.verbose)
    # late: the command line parses its arguments before torch and transformers load
    from trainer.commands.sft import load_sft_recipe, run_sft_command

    if args.print_config:
        return _printed(lambda: load_sft_recipe(args.recipe, args.overrides))
    return run_sft_command(args.recipe, args.overrides, overwrite=args.overwrite, resume=args.resume)


def _train_rm(args) -> int:
    if args.own_console and not args.print_config:  # as _sft
        third_party_output.install(verbose=args.verbose)
    # late: the command line parses its arguments before torch and transformers load
    from trainer.commands.train_rm import load_rm_recipe, run_train_rm_command

    if args.print_config:
        return _printed(lambda: load_rm_recipe(args.recipe, args.overrides))
    return run_train_rm_command(args.recipe, args.overrides, resume=args.resume)


def _printed(load, checked: str = "the recipe's checks passed") -> int:
    """``--print-config``: the resolved recipe on stdout (data: YAML only), what was checked on stderr."""
    try:
        status = print_config(load())
    except RecipeError as e:
        print(e.lines("parityrl: invalid recipe: "), file=sys.stderr)
        return 2
    print(f"parityrl: {checked}", file=sys.stderr)
    return status


def _merge(args) -> int:
    from trainer.commands.merge import MergeError, describe, merge_adapter  # late: as _train

    try:
        out = merge_adapter(args.base, args.adapter, args.out, dtype=args.dtype)
    except MergeError as e:
        print(f"parityrl merge: {e}", file=sys.stderr)
        return 2
    print(describe(out))
    return 0


def _serve(args) -> int:
    # late: as _train
    from trainer.commands.serve import run_serve
    from trainer.lifecycle.preflight import load_recipe

    try:
        cfg = load_recipe(args.recipe, args.overrides)
        if args.own_console and not args.dry_run:  # the server inherits the filtered fds: its expected lines -> server.log
            third_party_output.install(verbose=args.verbose)
        return run_serve(cfg, tensor_parallel_size=args.tensor_parallel_size, transfer_backend=args.transfer_backend,
                         dry_run=args.dry_run)
    except RecipeError as e:
        print(e.lines("parityrl: invalid recipe: "), file=sys.stderr)
        return 2


def _doctor(args) -> int:
    # late: as _train
    from trainer.commands.doctor import run_doctor

    if args.recipe is None and args.model is None:
        print("parityrl doctor: expected a recipe, or --model PATH", file=sys.stderr)
        return 2
    if args.own_console:  # vLLM's expected warnings go to the report's engine.log, as a run's do
        third_party_output.install(verbose=args.verbose)
    return run_doctor(args.recipe, args.overrides, model=args.model, out=args.out, only=args.only,
                      overwrite=args.overwrite)


def _compare(args) -> int:
    # late: as _train
    from rollout.base import EngineCannotLoad
    from trainer.diagnostics.compare import run_compare
    from trainer.diagnostics.compare_inputs import CompareError
    from trainer.vision.identity import InputsDiffer

    if args.own_console:  # before vLLM is imported: its expected lines go to the report's engine.log
        third_party_output.install(verbose=args.verbose)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)
    try:
        summary = run_compare(
            args.model, args.prompts, args.out, engine=args.engine, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, max_new_tokens=args.max_new_tokens, n=args.n, seed=args.seed, dtype=args.dtype,
            num_prompts=args.num_prompts, prompt_column=args.prompt_column,
            use_chat_template={"auto": None, "on": True, "off": False}[args.chat_template],
            max_prompt_tokens=args.max_prompt_tokens, max_model_len=args.max_model_len,
            kv_cache_bytes=args.kv_cache_bytes, batch_size=args.batch_size, self_check=args.self_check, topk=args.topk,
            precision=args.precision, system_prompt=args.system_prompt, adapter=args.adapter,
            image_column=args.image_column, overwrite=args.overwrite, progress=progress)
    except (CompareError, FileExistsError, ImportError) as e:
        print(f"parityrl compare: {e}", file=sys.stderr)
        return 2
    except EngineCannotLoad as e:
        print(f"parityrl compare: {e}", file=sys.stderr)
        return e.exit_status
    except InputsDiffer as e:  # as a run's parity stop: the two sides would compare other prompts
        print(f"parityrl compare: {e}", file=sys.stderr)
        return 3
    print(_compare_digest(summary, args.out))
    check = summary.get("self_check_result")
    if check is not None and not check["passed"]:
        print(f"parityrl compare: SELF-CHECK FAILED: {check}", file=sys.stderr)
        return 1
    return 0


def level_line(mae: float, level: dict, dtype: str, precision: str) -> str:
    """The mae's verdict against the healthy level (``summary.json``'s ``expected_level``), in one line."""
    ratio = mae / level["parity/mae"] if level["parity/mae"] > 0 else math.inf
    reading = {"PASS": "at or below the level",
               "WARN": f"above the level, within {level['warn_factor']:g}x of it: a healthy setup can read this",
               "FAIL": f"more than {level['warn_factor']:g}x the level: not rounding"}[level["verdict"]]
    return (f"{level['verdict']}: mae {mae:.2e} against the level {level['parity/mae']:.1e} a healthy setup reads in "
            f"{dtype}, precision {precision}, on a model of {level['num_layers']} layers ({ratio:.2g}x; "
            f"docs/parity-metrics.md): {reading}"
            + ("" if level["verdict"] == "PASS" else "; `parityrl doctor` says where the gap comes from"))


def _compare_digest(summary: dict, out: str) -> str:
    m = summary["metrics"]
    fmt = lambda k, f=".3e": format(m[k], f) if k in m else "n/a"
    lines = [
        "=== parityrl compare ===",
        f"engine {summary['settings']['engine']}  vs  trainer (HF)   {summary['num_prompts']} prompts, "
        f"{summary['num_samples']} samples, {summary['num_tokens']} tokens"
        + ("   [self-check]" if summary["self_check"] else ""),
        f"mae {fmt('parity/mae')}   rmse {fmt('parity/rmse')}   max |d| {fmt('parity/max_abs')}   "
        f"p99 |d| {fmt('parity/p99_abs')}",
        f"kl_k3 {fmt('parity/kl_k3')}   pearson {fmt('parity/pearson', '.6f')}   "
        f"prob_mae {fmt('parity/prob_mae')}   rho outside [0.9, 1.1] {fmt('parity/frac_rho_outside_0.9_1.1', '.4f')}",
    ]
    level = summary.get("expected_level")
    if level and not summary["self_check"]:
        s = summary["settings"]
        lines.append(level_line(m["parity/mae"], level, s["dtype"], s["precision"]))
    if "routing" in summary:  # an MoE model: replayed, and the same tokens without replay
        r, u = summary["routing"], summary["routing"]["unreplayed"]
        lines.append(f"routing agree {r['parity/routing_agree']:.4f} (tokens differing in a layer "
                     f"{r['parity/routing_tokens_any_diff']:.4f}); without replay: kl_k3 {u['parity/kl_k3']:.3e}, "
                     f"max |d| {u['parity/max_abs']:.3e}")
    if "images" in summary:  # a vision-language model's prompts with their images
        im = summary["images"]
        lines.append(f"images: {im['images']} in {im['prompts_with_images']} of {summary['num_prompts']} prompts, "
                     f"inputs identical on both sides ({im['samples_checked']} samples)"
                     + (f"; mae with images {im['parity/images/mae']:.3e}" if "parity/images/mae" in im else "")
                     + (f", text alone {im['parity/text/mae']:.3e}" if "parity/text/mae" in im else ""))
    if "lora_sync" in summary:  # a run's adapter: served and merged on the same prompts
        ls = summary["lora_sync"]
        for mode in ("adapter", "merged"):
            if mode in ls:
                lines.append(f"{mode:<8} mae {ls[mode]['parity/mae']:.3e}   kl_k3 {ls[mode]['parity/kl_k3']:.3e}   "
                             f"max |d| {ls[mode]['parity/max_abs']:.3e}" + ("   (served)" if ls["served"] == mode else ""))
        cost = ls["merge_cost"]
        if "sync/merge_update_error" in cost:
            lines.append(f"merging loses {cost['sync/merge_update_error']:.1%} of the adapter's update "
                         f"({cost['sync/merge_unchanged_frac']:.1%} of the weights do not move)")
    if "self_check_result" in summary:
        lines.append(f"self-check {'passed' if summary['self_check_result']['passed'] else 'FAILED'}")
    lines.append(f"report  {out}")
    return "\n".join(lines)


def quiet_third_party() -> None:
    """Keep the console for parityrl's progress lines; engines' own logs stay available by setting the variables."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    # vLLM runs in this process next to the trainer; its V1 engine must not fork a
    # worker process (set before vllm is imported anywhere).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    quiet_third_party()
    args = build_parser().parse_args(argv)
    # The console filter acts on file descriptors, i.e. the whole process: only for the process's own
    # command line, never for an in-process call (a test, a notebook calling main([...])).
    args.own_console = argv is None
    if args.command == "train":
        return _train(args)
    if args.command == "compare":
        return _compare(args)
    if args.command == "train-rm":
        return _train_rm(args)
    if args.command == "merge":
        return _merge(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "doctor":
        return _doctor(args)
    return _sft(args)


if __name__ == "__main__":
    sys.exit(main())
