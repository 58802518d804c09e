"""Checks of a training recipe against what it names -- paths, run directory, reward functions, dataset, the
model (its config, weights' headers and tokenizer, or a hub id's reachability), LoRA targets and rank, and the
sizes the machine must hold -- before any model loads or engine starts.

``trainer.config`` checks the recipe on its own (types, ranges, cross-field rules); what needs a file or a
model looked at (the paths exist, a built-in model is known, a dataset's columns, a reward module's functions,
a model's layer names) is checked here, so that a mistake is refused in seconds with exit status 2 and one
line naming the file, the key and the value, instead of failing after the engine started or with a traceback.
Each check raises ``RecipeError``; ``inspect_recipe`` runs them all in one pass and keeps every problem, except
where a check needs what an earlier one refused (a dataset that is not there is not loaded; a model directory
that is not there is not read; a built-in model is built, the first time, only for a recipe with no other
problem).
"""
from __future__ import annotations

import inspect
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import datasets
import torch
import transformers
from transformers import AutoConfig

from rollout.cuda_driver import unusable_cuda_problem
from rollout.device_placement import PlacementError
from trainer.builtin.hub import hub_dataset_problem, hub_model_problem
from trainer.builtin.model_files import (
    config_problem,
    parameter_count,
    read_json,
    safetensors_header,
    tokenizer_problem,
    weight_files,
)
from trainer.builtin.model_path import check_model_path, looks_local, model_max_positions
from trainer.builtin.resolve import resolve_model_path
from trainer.config import RecipeError, RunConfig, read_recipe, read_recipe_leniently
from trainer.config.load import name_overrides
from trainer.config.validate import sequence_length
from trainer.data.datasets import load_prompt_dataset, looks_like_path
from trainer.data.tasks import PROMPT_SOURCES
from trainer.environments.episode_environment import EpisodeEnvironment
from trainer.lifecycle.capacity import Machine, ModelSize, capacity_problems, gpu_total_bytes, host_available_bytes
from trainer.lifecycle.extension_locks import check_extension_locks
from trainer.lifecycle.teacher_checks import check_teacher_at_hand
from trainer.lifecycle.teacher_memory import teacher_memory, teacher_size_at_hand
from trainer.models.architecture import ALL_LINEAR, resolve_lora_targets
from trainer.models.routing_mode import routing_mode
from trainer.precision import recipe_for
from trainer.precision.checks import check_model_config, check_recipe
from trainer.precision.lora_sync import lora_sync_mode
from trainer.rewards.functions import resolve_reward
from trainer.vision.images import image_column_problems
from trainer.vision.support import auto_model_class, vision_language_type


def load_recipe(path: str | os.PathLike, overrides: list[str] = (), *, check_paths: bool = True) -> RunConfig:
    """Read, override, type-check and validate a training recipe (``trainer.config.read_recipe``, with the
    rules of its precision recipe's record, ``trainer.precision``, in the same report), then check the paths it
    names (``check_paths``)."""
    cfg = read_recipe(path, overrides, checks=(check_recipe,))
    if check_paths:  # files only once the values are sound
        check_paths_exist(cfg, str(Path(path)))
    return cfg


def check_paths_exist(cfg: RunConfig, where: str) -> None:
    """Reward-model directories, the model (a known built-in or a model directory), a local data source, and
    the model's context against the longest rollout: the first problem found."""
    check_reward_model_dirs(cfg, where)
    check_model_path(cfg.model.path, where)
    if cfg.teacher.path:  # its tokenizer against the student's when the run starts (trainer/lifecycle/teacher_checks.py)
        check_model_path(cfg.teacher.path, where, key="teacher.path")
    check_data_source(cfg, where)
    check_context_length(cfg, where)


def check_reward_model_dirs(cfg: RunConfig, where: str) -> None:
    for name, rm in cfg.reward.models.items():
        if not (Path(rm.path).expanduser() / "config.json").is_file():
            raise RecipeError(f"{where}: reward.models.{name}.path = {rm.path!r}: expected a local reward-model "
                              "directory with a config.json (written by `parityrl train-rm`)")


def check_data_source(cfg: RunConfig, where: str) -> None:
    """``data.source`` and, when evaluation reads another one, ``eval.source``: a built-in dataset that exists, or
    a local file or directory that does; hub ids pass."""
    sources = [("data.source", cfg.data.source)]
    if cfg.eval.every and cfg.eval.source is not None:
        sources.append(("eval.source", cfg.eval.source))
    for key, src in sources:
        if src.startswith("builtin:"):
            if src.removeprefix("builtin:") not in PROMPT_SOURCES:
                raise RecipeError(f"{where}: {key} = {src!r}: unknown built-in dataset; expected one of "
                                  + ", ".join(repr("builtin:" + n) for n in PROMPT_SOURCES))
        # an explicit path prefix, or the data loader's own rule for "this is a file"
        elif (src.startswith((".", "/", "~")) or looks_like_path(src)) and not Path(src).expanduser().exists():
            raise RecipeError(f"{where}: {key} = {src!r}: no such file or directory")


def check_context_length(cfg: RunConfig, where: str) -> None:
    max_pos = model_max_positions(cfg.model.path)
    need_len = sequence_length(cfg)
    if max_pos is not None and need_len > max_pos and cfg.env.enabled:
        key = "env.max_tokens" if cfg.env.max_tokens is not None else "env.max_turns"
        value = cfg.env.max_tokens if cfg.env.max_tokens is not None else cfg.env.max_turns
        raise RecipeError(
            f"{where}: {key} = {value}: an episode's token budget of {need_len} (env.max_tokens, by default "
            "data.max_prompt_tokens + env.max_turns x (rollout.max_new_tokens + env.max_observation_tokens)) exceeds "
            f"the model's context of {max_pos} tokens; expected env.max_tokens <= {max_pos}")
    if max_pos is not None and need_len > max_pos:
        raise RecipeError(
            f"{where}: rollout.max_new_tokens = {cfg.rollout.max_new_tokens}: data.max_prompt_tokens "
            f"({cfg.data.max_prompt_tokens}) + max_new_tokens = {need_len} exceeds the model's context of {max_pos} tokens"
        )
    t = cfg.teacher
    # A vLLM teacher scores a sequence as a prompt and samples one token after it (prompt log-probs come with a
    # generate): its engine needs one position more than the student's longest sequence.
    teacher_pos = model_max_positions(t.path) if t.path and t.engine == "vllm" else None
    if teacher_pos is not None and need_len + 1 > teacher_pos:
        key, value = (("env.max_tokens", cfg.env.max_tokens) if cfg.env.enabled and cfg.env.max_tokens is not None
                      else ("rollout.max_new_tokens", cfg.rollout.max_new_tokens))
        raise RecipeError(
            f"{where}: {key} = {value}: the student's sequences of up to {need_len} tokens need {need_len + 1} "
            f"positions in the teacher's engine (teacher.engine {t.engine} samples one token after a scored "
            f"sequence), more than teacher.path {t.path!r}'s context of {teacher_pos}; expected sequences of at most "
            f"{teacher_pos - 1} tokens, or teacher.engine hf")


# The key a problem line names: "<where>: key = value: ..." or "<where>: unknown key 'key'; ..." (<where> is
# the file, or a "--set key=value" whose value may hold ": ").
_NAMED_KEY = re.compile(r": (?:unknown key '([^']+)'|([A-Za-z_][\w.\[\]-]*) = )")


class Report:
    """The problems found so far, one line each, as checks run one after another.

    ``run`` keeps a check's problems, except a line about a key the recipe's own problems already named (or one
    its lenient build left at the default, ``refused``): that check judged a refused value, not the user's."""

    def __init__(self, error: Optional[RecipeError] = None, refused: Iterable[str] = ()) -> None:
        self.lines: list[str] = list(error.problems) if error is not None else []
        self._named = set(refused) | {k for line in self.lines if (k := named_key(line))}

    def run(self, check: Callable[..., Any], *args) -> tuple[bool, Any]:
        """(passed, what the check returned): a check that failed returns nothing its dependants could use."""
        try:
            return True, check(*args)
        except RecipeError as e:
            self.keep([e])
            return False, None
        except Exception:
            if not self.lines:
                raise
            return False, None  # a check tripping over a value already refused

    def keep(self, errors: list[RecipeError]) -> None:
        for line in (line for e in errors for line in e.problems):
            key = named_key(line)
            if key is None or not any(key == k or key.startswith(k + ".") for k in self._named):
                self.lines.append(line)

    def raise_any(self) -> None:
        if self.lines:
            raise RecipeError.several([RecipeError(line) for line in self.lines])


def named_key(line: str) -> Optional[str]:
    m = _NAMED_KEY.search(line)
    return (m.group(1) or m.group(2)) if m else None


def inspect_recipe(path: str | os.PathLike, overrides: list[str] = (), *, model: bool = True
                   ) -> tuple[RunConfig, list[str]]:
    """Every problem of a training recipe found before a model loads, in one pass: (the config, one line per
    problem). The recipe's own (keys, types, values, cross-field rules) first, then what it names
    (``preflight``), checked on the recipe as far as it could be built (``read_recipe_leniently``).
    ``model``: the model's checks too (``preflight``'s last ones; ``--print-config`` leaves them out)."""
    cfg, error, refused = read_recipe_leniently(path, overrides, checks=(check_recipe,))
    where = str(Path(path))
    report = Report(error, refused)
    preflight(cfg, where, model=model, report=report)
    if not report.lines:
        return cfg, []
    # a problem with a value a --set gave names that --set, as the recipe's own problems do
    return cfg, name_overrides(RecipeError.several([RecipeError(line) for line in report.lines]), where,
                               overrides).problems


def check_before_loading(path: str | os.PathLike, overrides: list[str] = (), *, model: bool = True) -> RunConfig:
    """``inspect_recipe``, raising one ``RecipeError`` with every problem."""
    cfg, lines = inspect_recipe(path, overrides, model=model)
    if lines:
        raise RecipeError.several([RecipeError(line) for line in lines])
    return cfg


def preflight(cfg: RunConfig, where: str, *, model: bool = True, report: Optional[Report] = None) -> None:
    """Every check of what the recipe names, cheapest first, each problem kept (``Report``): a CUDA build of torch
    that reaches no GPU, a dead extension build's lock a DeepSpeed launch would hang on, the run directory, the reward functions, the dataset and whether the functions take its
    columns, the model's path and context; then (``model``) the model's checks: its config (or a hub id's reachability), its layers (LoRA), its
    precision recipe, its weights' headers and tokenizer, and the sizes the machine must hold."""
    own = report is None
    report = Report() if own else report
    report.run(check_cuda_usable, where)
    report.run(check_extension_locks, where)
    report.run(check_run_dir, cfg, where)
    report.run(check_reward_model_dirs, cfg, where)
    fns, problems = reward_functions(cfg, where)
    report.keep(problems)
    source_ok, _ = report.run(check_data_source, cfg, where)
    columns = report.run(check_dataset, cfg, where)[1] if source_ok else None
    if columns is not None:  # an episode's reward functions also receive its conversation (trainer/sampling/episode_sampler.py)
        report.run(check_reward_signatures, fns, columns + (["messages"] if cfg.env.enabled else []), where)
    if cfg.env.enabled:
        report.run(EpisodeEnvironment.from_config, cfg, where)
    model_ok, _ = report.run(check_model_path, cfg.model.path, where)
    if cfg.teacher.path and report.run(check_model_path, cfg.teacher.path, where, "teacher.path")[0] and model_ok:
        report.run(check_teacher_at_hand, cfg, where)  # the models here already: nothing built for it
    if model_ok:
        report.run(check_context_length, cfg, where)
    # a built-in model is built on first use (minutes): not to check a recipe that is refused anyway
    if model and model_ok and not (report.lines and cfg.model.path.startswith("builtin:")):
        _check_model(cfg, where, report)
    if own:
        report.raise_any()


def _check_model(cfg: RunConfig, where: str, report: Report) -> None:
    if not report.run(check_model_source, cfg, where)[0]:
        return
    report.run(check_lora_targets, cfg, where)
    report.run(check_images_and_model, cfg, where)
    report.run(check_precision_model, cfg, where)
    report.run(check_routing, cfg, where)
    report.run(check_lora_sync, cfg, where)
    files_ok, size = report.run(check_model_files, cfg, where)
    if files_ok:
        report.run(check_capacity, cfg, where, size)


def check_images_and_model(cfg: RunConfig, where: str) -> None:
    """An image column needs a vision-language model (the model's config.json says, no weights read)."""
    column = cfg.data.image_column
    config = local_model_config(resolve_model_path(cfg.model.path)) if column is not None else None
    if config is not None and not vision_language_type(config.model_type):
        raise RecipeError(f"{where}: data.image_column = {column!r}: model.path {cfg.model.path!r} is a text-only "
                          f"model (model_type {config.model_type!r}); images need a vision-language model "
                          "(docs/vision-language.md)")


def local_model_config(model_dir: str):
    """The model's config, or None when it cannot be read here (a hub id offline)."""
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


def check_cuda_usable(where: str) -> None:
    """A CUDA build of torch that reaches no GPU while vLLM sees NVIDIA GPUs (a driver too old for the wheels'
    CUDA, ``rollout.cuda_driver``): refused, instead of a run on the CPU paths of a GPU machine."""
    problem = unusable_cuda_problem()
    if problem:
        raise RecipeError(f"{where}: {problem}")


def check_model_source(cfg: RunConfig, where: str) -> None:
    """A local model directory's config.json (parses, names a causal LM Transformers builds), or a hub id that
    can be loaded from here (cached, or the hub reachable: ``trainer.builtin.hub``). Built-ins are the trainer's
    own."""
    mp = cfg.model.path
    if mp.startswith("builtin:"):
        return
    if looks_local(mp):
        problem = config_problem(Path(mp).expanduser())
    else:
        problem = hub_model_problem(mp)
    if problem:
        raise RecipeError(f"{where}: model.path = {mp!r}: {problem}")


def check_model_files(cfg: RunConfig, where: str) -> Optional[ModelSize]:
    """A local model directory's weights (present; each safetensors file's header sound and its tensors within
    the file) and tokenizer. Returns the model's size for ``check_capacity`` (None: not known from here)."""
    mp = cfg.model.path
    if not (mp.startswith("builtin:") or looks_local(mp)):
        return None
    model_dir = Path(resolve_model_path(mp))
    files, problem = weight_files(model_dir)
    headers = []
    for f in files:
        if problem:
            break
        header, problem = safetensors_header(f)
        headers.append(header)
    problem = problem or tokenizer_problem(model_dir)
    if problem:
        raise RecipeError(f"{where}: model.path = {mp!r}: {problem}")
    config, _ = read_json(model_dir / "config.json")
    if not files or not isinstance(config, dict):  # PyTorch .bin weights: no header to count from
        return None
    return ModelSize(parameters=parameter_count(headers), config=config)


def check_capacity(cfg: RunConfig, where: str, size: Optional[ModelSize],
                   machine: Optional[Machine] = None) -> None:
    """Sizes the machine running the run cannot hold (``trainer.lifecycle.capacity``): every one found, at once."""
    if machine is None:
        try:
            gpu = gpu_total_bytes() if cfg.rollout.engine == "vllm" and cfg.rollout.mode == "colocate" else None
        except PlacementError as e:
            raise RecipeError(f"{where}: {e}") from None
        machine = Machine(host_available=host_available_bytes(), gpu_total=gpu)
    recipe = recipe_for(cfg.precision.recipe)
    fp8 = recipe.block_fp8_on_cuda and machine.gpu_total is not None
    # a colocated teacher's engine (and its copy in the trainer for teacher_parity/*) beside the student's
    teacher_size = teacher_size_at_hand(cfg)
    teacher = None if teacher_size is None else teacher_memory(
        cfg, teacher_size, max_model_len=sequence_length(cfg) + 1, cuda=machine.gpu_total is not None, fp8=fp8)
    problems = capacity_problems(cfg, where, machine, size, engine_weight_bytes_per_param=1 if fp8 else None,
                                 teacher=teacher)
    if problems:
        raise RecipeError.several([RecipeError(p) for p in problems])


def check_precision_model(cfg: RunConfig, where: str) -> None:
    """The model's config against what the precision recipe can run (its record's ``check_model``)."""
    recipe = recipe_for(cfg.precision.recipe)
    if recipe.check_model is None:
        return
    try:
        config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    except (OSError, ValueError):  # a hub id without network: setup checks it again with the loaded model
        return
    check_model_config(recipe, config, where=where, model_path=cfg.model.path)


def check_routing(cfg: RunConfig, where: str) -> None:
    """``parity.routing_replay`` against the model's config and the rollout mode (``routing_mode``)."""
    try:
        config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    except (OSError, ValueError):  # a hub id without network: the run checks it again with the loaded model
        return
    try:
        routing_mode(cfg.parity.routing_replay, config, where=where)
    except ValueError as e:
        raise RecipeError(str(e)) from None


def check_lora_sync(cfg: RunConfig, where: str) -> None:
    """An explicit ``rollout.lora_sync: adapter`` against what the model adds to the recipe's own reasons for the
    merged weights (``trainer.precision.lora_sync``: an MoE model on vLLM's CPU build)."""
    if cfg.rollout.lora_sync != "adapter":
        return
    try:
        config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    except (OSError, ValueError):  # a hub id without network: the engine's start decides with the loaded model
        return
    try:
        lora_sync_mode(cfg, model_config=config)
    except RecipeError as e:
        raise RecipeError(f"{where}: {e}") from None


def check_run_dir(cfg: RunConfig, where: str) -> None:
    """The run directory is a directory, or can be created (its nearest existing ancestor is a writable directory)."""
    run_dir = Path(cfg.run_dir)
    key = f"logging.run_dir = {cfg.logging.run_dir!r}"
    if run_dir.exists() and not run_dir.is_dir():
        raise RecipeError(f"{where}: {key}: {str(run_dir)!r} exists and is not a directory; expected a directory "
                          "for the run's checkpoints and metrics")
    ancestor = run_dir.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RecipeError(f"{where}: {key}: {str(ancestor)!r} is a file, so no directory can be created under it")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RecipeError(f"{where}: {key}: {str(ancestor)!r} is not writable by this user")


def check_reward_functions(cfg: RunConfig, where: str) -> dict:
    """Every ``reward.functions`` spec imports and names a callable: name -> the callable."""
    fns, problems = reward_functions(cfg, where)
    if problems:
        raise RecipeError.several(problems)
    return fns


def reward_functions(cfg: RunConfig, where: str) -> tuple[dict, list[RecipeError]]:
    """(name -> callable for each spec that resolves, one problem per spec that does not)."""
    fns, problems = {}, []
    for name, spec in cfg.reward.functions.items():
        try:
            fns[name] = resolve_reward(spec)
        except (ImportError, AttributeError, TypeError, ValueError, OSError) as e:
            problems.append(RecipeError(f"{where}: reward.functions.{name} = {spec!r}: {_one_line(e)}"))
    return fns, problems


def check_reward_signatures(fns: dict, columns: list[str], where: str) -> None:
    """Each function accepts ``(prompts, completions, **columns)`` with this dataset's columns."""
    others = {c: [] for c in columns if c != "prompt"}
    for name, fn in fns.items():
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins and some C callables have no signature: nothing to check
            continue
        try:
            sig.bind([], [], **others)
        except TypeError as e:
            raise RecipeError(f"{where}: reward.functions.{name}: {getattr(fn, '__qualname__', fn)}{sig} cannot be "
                              f"called as f(prompts, completions, **columns) with the dataset's columns "
                              f"{sorted(others)}: {e} (add **kwargs to accept the columns it does not use)") from None


def check_dataset(cfg: RunConfig, where: str) -> Optional[list[str]]:
    """Load a local or built-in dataset as training will: parse errors, missing columns, too few rows.

    Returns its column names, or None for a hub dataset: that one is only looked up (cached, or the hub has
    it: ``trainer.builtin.hub``); loading it is left to training.
    """
    d = cfg.data
    if not (d.source.startswith("builtin:") or looks_like_path(d.source) or Path(d.source).expanduser().exists()):
        problem = hub_dataset_problem(d.source)
        if problem:
            raise RecipeError(f"{where}: data.source = {d.source!r}: {problem}")
        return None
    bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    # The console is for the one line below, if any: no progress bars, and not the loader's own error
    # log of a parse failure (a traceback-like block; the line below names the file and line instead).
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():  # the loop's load says them again, once the run starts
            warnings.simplefilter("ignore")
            ds = load_prompt_dataset(d.source, split=d.split, prompt_column=d.prompt_column,
                                     answer_column=d.answer_column, num_examples=d.num_examples,
                                     seed=cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
    except (ValueError, TypeError, OSError) as e:
        raise RecipeError(f"{where}: data.source = {d.source!r}: {_one_line(e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    if d.image_column is not None:  # every row's images decoded once, before anything loads
        if d.image_column not in ds.column_names:
            raise RecipeError(f"{where}: data.image_column = {d.image_column!r}: no such column in {d.source} "
                              f"(its columns: {', '.join(ds.column_names)})")
        bad = image_column_problems(ds, d.image_column)
        if bad:
            raise RecipeError(f"{where}: data.source = {d.source!r}: " + "; ".join(bad))
    n = cfg.rollout.prompts_per_step
    if len(ds) < n:
        rows = f"{len(ds)} rows" + (f" (data.num_examples = {d.num_examples})" if d.num_examples is not None else "")
        raise RecipeError(f"{where}: rollout.prompts_per_step = {n}: expected at most the dataset's {rows} "
                          f"({d.source}); set rollout.prompts_per_step to {len(ds)} or fewer "
                          f"(--set rollout.prompts_per_step={len(ds)})")
    return list(ds.column_names)


# Layer types PEFT's LoRA can wrap (torch.nn.Linear and friends; GPT-2's Conv1D).
_LORA_LAYERS = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D")


def lora_target_problems(module_types: dict[str, str], targets: list[str]) -> list[str]:
    """Why each of ``targets`` would not be adapted, given the model's ``{module name: class name}``.

    PEFT matches a name when it equals the module's full name or is its last dotted parts; a
    target matching nothing is ignored by PEFT (or, if all are, fails mid-setup), so every one
    must match at least one layer LoRA can wrap.
    """
    problems = []
    for t in targets:
        hits = [n for n in module_types if n == t or n.endswith("." + t)]
        if not hits:
            problems.append(f"{t!r} matches no module")
        elif not any(module_types[n] in _LORA_LAYERS for n in hits):
            problems.append(f"{t!r} matches {module_types[hits[0]]} modules, which LoRA cannot wrap")
    return problems


def meta_model(model_dir: str):
    """The model built on the meta device from its config (no weights read); None if the config is unreachable."""
    config = local_model_config(model_dir)
    if config is None:  # a hub id without network: left to training
        return None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the console is for the one line of a refusal, not build notes
    try:
        with torch.device("meta"):
            return auto_model_class(config.model_type).from_config(config)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _meta_model(cfg: RunConfig, where: str):
    """``meta_model`` of the recipe's model; a config Transformers cannot build a model from is refused."""
    model_dir = resolve_model_path(cfg.model.path)
    try:
        return meta_model(model_dir)
    except Exception as e:  # noqa: BLE001 - from_config raises what each architecture's __init__ raises
        raise RecipeError(f"{where}: model.path = {cfg.model.path!r}: its config.json does not build a model "
                          f"({type(e).__name__}: {_one_line(e)[:200]})") from None


def check_lora_targets(cfg: RunConfig, where: str, targets: Optional[list[str]] = None) -> None:
    """``targets`` (default ``model.lora.target_modules``) against the model's layers, resolved as training
    resolves them (``trainer.models.architecture.resolve_lora_targets``: ``all-linear``, tied embeddings)."""
    targets = cfg.model.lora.target_modules if targets is None else targets
    model = _meta_model(cfg, where)
    if model is None:
        return
    types = {n: type(m).__name__ for n, m in model.named_modules() if n}
    explicit = [t for t in targets if t != ALL_LINEAR]
    problems = lora_target_problems(types, explicit)
    if problems:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, t in types.items() if t in _LORA_LAYERS})
        raise RecipeError(f"{where}: model.lora.target_modules = {targets!r}: {'; '.join(problems)} of "
                          f"{cfg.model.path}; its layers LoRA can wrap: {', '.join(leaves)}")
    try:
        resolved = resolve_lora_targets(model, targets)
    except RecipeError as e:
        raise RecipeError(f"{where}: {e}") from None
    except TypeError as e:  # no decoder layers where the trainer looks for them (an encoder, e.g. BERT)
        raise RecipeError(f"{where}: model.path = {cfg.model.path!r}: {_one_line(e)}") from None
    check_lora_rank(cfg, where, {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in resolved})


def check_lora_rank(cfg: RunConfig, where: str, adapted: dict) -> None:
    """``model.lora.r`` at most the smallest dimension of the layers it adapts ({name: module}): the update B A
    of an (out x in) layer has rank at most min(out, in), so a larger r only adds parameters (r x (out + in)
    each) that cannot raise it; a huge r is an allocation that cannot succeed."""
    r = cfg.model.lora.r
    dims = {n: _dims(m) for n, m in adapted.items()}
    dims = {n: d for n, d in dims.items() if d}
    if not dims:
        return
    name, (out_dim, in_dim) = min(dims.items(), key=lambda kv: min(kv[1]))
    if r > min(out_dim, in_dim):
        raise RecipeError(f"{where}: model.lora.r = {r}: expected at most {min(out_dim, in_dim)}, the smallest "
                          f"dimension of the layers it adapts ({name}: {out_dim} x {in_dim} in {cfg.model.path}); "
                          "a LoRA update has rank at most min(out, in), a larger r adds parameters but not rank")


def _dims(module) -> Optional[tuple[int, int]]:
    """(out, in) of a layer LoRA wraps: Linear, GPT-2's Conv1D (weight in x out), Embedding (num x dim)."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.out_features, module.in_features
    if hasattr(module, "nf") and hasattr(module, "nx"):  # transformers.pytorch_utils.Conv1D
        return module.nf, module.nx
    if hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim"):
        return module.embedding_dim, module.num_embeddings
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
