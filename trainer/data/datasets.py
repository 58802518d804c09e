"""Prompt datasets: loading from any source, tokenising prompts, and a resumable batch order.

Sources (``load_prompt_dataset``):

* ``builtin:<name>`` — a generated task from ``trainer.data.tasks.BUILTIN_DATASETS``
  (e.g. ``builtin:arithmetic``); extra generator arguments via ``builtin_kwargs``.
* a local ``.json`` / ``.jsonl`` / ``.parquet`` file, or a directory written by
  ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
* anything else is a Hugging Face Hub id: ``datasets.load_dataset(source, split=split)``
  (needs a network or a warm HF cache).

Whatever the source, the result has a ``prompt`` column of strings and keeps
every other column, because reward functions receive them as keyword
arguments (``f(prompts, completions, **columns)``).
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets

from trainer.config.schema import RecipeError
from trainer.config.utf8 import utf8_problem
from trainer.data.tasks import BUILTIN_DATASETS, DEFAULT_NUM_EXAMPLES

__all__ = ["PromptBatcher", "apply_prompt_budget", "chat_messages", "check_prompt_lengths", "encode_prompts", "load_prompt_dataset"]

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Suffixes that mark a source as a file path rather than a Hub id, so a missing
# file is reported as such instead of as a failed Hub download.
_PATH_LIKE_SUFFIXES = {".json", ".jsonl", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zst", ".xz"}


def load_prompt_dataset(
    source: str,
    *,
    split: str = "train",
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    num_examples: int | None = None,
    seed: int = 0,
    builtin_kwargs: dict[str, Any] | None = None,
) -> datasets.Dataset:
    """Load a prompt dataset and normalise its columns.

    Args:
        source: ``builtin:<name>``, a local file/directory, or a Hub id (see module doc).
        split: split to generate (builtin), select (DatasetDict directory, Hub);
            ignored for a single local file, which is one split.
        prompt_column: column holding the prompt strings; renamed to ``prompt``.
        answer_column: column that must exist and is renamed to ``answer``
            (what the built-in rewards read); ``None`` for no answer column.
        num_examples: builtin: rows to generate (default
            ``trainer.data.tasks.DEFAULT_NUM_EXAMPLES[split]``); other sources: keep
            the first ``num_examples`` rows (a warning if there are fewer).
        seed: seed of a builtin generator.
        builtin_kwargs: extra keyword arguments of a builtin generator,
            e.g. ``{"max_operand": 10}``; only valid with ``builtin:`` sources.

    Returns:
        ``datasets.Dataset`` with a string ``prompt`` column (and ``answer`` if
        requested) plus all other columns of the source.
    """
    if num_examples is not None and (not isinstance(num_examples, int) or num_examples <= 0):
        raise ValueError(f"num_examples={num_examples!r} must be a positive int or None")
    if builtin_kwargs and not source.startswith("builtin:"):
        raise ValueError(f"builtin_kwargs={builtin_kwargs!r} is only valid with a builtin: source, not {source!r}")
    if source.startswith("builtin:"):
        ds = _load_builtin(source, split, num_examples, seed, builtin_kwargs or {})
    else:
        path = Path(source).expanduser()
        if path.exists() or looks_like_path(source):
            ds = _load_local(path, split, prompt_column)
        else:
            ds = _as_dataset(datasets.load_dataset(source, split=split), source, split)
        if num_examples is not None:
            if num_examples > len(ds):
                warnings.warn(
                    f"num_examples={num_examples} but {source!r} has only {len(ds)} rows; using all of them",
                    stacklevel=2,
                )
            ds = ds.select(range(min(num_examples, len(ds))))
    ds = _normalise_columns(ds, source, prompt_column, answer_column)
    _check_prompt_rows(ds, source, prompt_column)
    return ds


def _load_builtin(source: str, split: str, num_examples: int | None, seed: int, kwargs: dict) -> datasets.Dataset:
    name = source.removeprefix("builtin:")
    if name not in BUILTIN_DATASETS:
        valid = sorted("builtin:" + n for n in BUILTIN_DATASETS)
        raise ValueError(f"unknown builtin dataset {source!r}; expected one of {valid}")
    n = num_examples if num_examples is not None else DEFAULT_NUM_EXAMPLES.get(split, DEFAULT_NUM_EXAMPLES["train"])
    return BUILTIN_DATASETS[name](n, seed=seed, split=split, **kwargs)


def looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~", ".\\")) or Path(source).suffix.lower() in _PATH_LIKE_SUFFIXES


def single_split_source(source: str) -> bool:
    """A local file, or a save_to_disk directory of one Dataset: sources with no named splits."""
    p = Path(source).expanduser()
    if source.startswith("builtin:") or not p.exists():
        return False
    return p.is_file() or not (p / "dataset_dict.json").is_file()


def _load_local(path: Path, split: str, prompt_column: str = "prompt") -> datasets.Dataset:
    if not path.exists():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    if not path.is_dir() and path.suffix.lower() not in _FILE_BUILDERS:
        raise ValueError(
            f"unsupported dataset file extension {path.suffix!r} for {str(path)!r};"
            f" expected one of {sorted(_FILE_BUILDERS)} or a save_to_disk directory"
        )
    # `datasets` fails on zero-row sources with unrelated-looking errors
    # (IndexError, StopIteration, 'Instruction "train" corresponds to no data!').
    if _is_empty_local(path):
        raise ValueError(f"dataset {str(path)!r} is empty")
    if path.is_dir():
        return _as_dataset(datasets.load_from_disk(str(path)), str(path), split)
    if path.suffix.lower() in (".json", ".jsonl"):
        # Arrow's JSON reader does not validate UTF-8: a bad byte loads, then fails when its row is first read
        # (mid-run); one pass over the file here names it (offset, line) before anything starts.
        problem = utf8_problem(path)
        if problem:
            raise ValueError(f"{path}: {problem}")
    try:
        return datasets.load_dataset(_FILE_BUILDERS[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as e:  # datasets' own errors name neither the file nor the line
        raise ValueError(_json_problem(path, prompt_column)
                         or f"{str(path)!r} could not be read: {type(e).__name__}: {e}") from e


def _json_problem(path: Path, prompt_column: str = "prompt") -> str | None:
    """'file:line: ...' for the first line of a JSON / JSON Lines file that is not a JSON object, or whose
    prompt is not a string (Arrow refuses a column whose rows change type), else None."""
    if path.suffix.lower() not in (".json", ".jsonl"):
        return None
    text = path.read_text(errors="replace")
    if path.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            if not _first_line_is_json(text):  # one document, not JSON Lines: its own error position
                return f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        else:
            for i, row in enumerate(rows if isinstance(rows, list) else []):
                if isinstance(row, dict) and prompt_column in row and not isinstance(row[prompt_column], str):
                    return f"{path}: row {i}: {_not_a_prompt(prompt_column, row[prompt_column])}"
            return None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}): {line.strip()[:60]!r}"
        if not isinstance(row, dict):
            return f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}"
        if prompt_column in row and not isinstance(row[prompt_column], str):
            return f"{path}:{lineno}: {_not_a_prompt(prompt_column, row[prompt_column])}"
    return None


def _not_a_prompt(column: str, value: Any) -> str:
    what = "null (or missing)" if value is None else f"{json.dumps(value)[:60]} ({type(value).__name__})"
    hint = " (chat-message lists are not supported; put the user message text in the column)" if isinstance(
        value, list) else ""
    return f"{column} is {what}; expected strings (one in every row){hint}"


def _check_prompt_rows(ds: datasets.Dataset, source: str, prompt_column: str) -> None:
    """Every row has a prompt: a string column can hold nulls (a JSON ``null``, or a row without the key),
    which would otherwise reach the engine mid-run. Named by row, and by line for a JSON Lines file."""
    # The Arrow null count is kept per column (no scan); only a column with nulls is read row by row.
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    if table.column("prompt").null_count == 0:
        return
    row = next((i for i, p in enumerate(ds["prompt"]) if p is None), None)
    if row is None:  # the nulls are in rows a num_examples selection left out
        return
    path = Path(source).expanduser()
    line = _jsonl_line(path, row) if path.suffix.lower() == ".jsonl" and path.is_file() else None
    where = f"{path}:{line}" if line else f"{source}: row {row}"
    raise ValueError(f"{where}: {_not_a_prompt(prompt_column, None)}")


def _jsonl_line(path: Path, row: int) -> int | None:
    """The line number of row ``row`` of a JSON Lines file (blank lines hold no row)."""
    seen = -1
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                seen += 1
                if seen == row:
                    return lineno
    return None


def _first_line_is_json(text: str) -> bool:
    try:
        json.loads(text.strip().splitlines()[0])
        return True
    except (json.JSONDecodeError, IndexError):
        return False


def _is_empty_local(path: Path) -> bool:
    """True for sources with no rows: blank/``[]`` JSON, zero-row parquet, a save_to_disk dir with no shards."""
    if path.is_dir():
        state = path / "state.json"  # a DatasetDict directory has per-split subdirectories instead
        return state.is_file() and not json.loads(state.read_text()).get("_data_files")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows == 0
    if path.stat().st_size > 1024:
        return False
    return path.read_bytes().strip() in (b"", b"[]")  # bytes: a file that is not UTF-8 is named by the loader


def _as_dataset(obj: Any, source: str, split: str) -> datasets.Dataset:
    """A Dataset from a Dataset or a DatasetDict (selecting ``split``)."""
    if isinstance(obj, datasets.DatasetDict):
        if split not in obj:
            raise ValueError(f"split={split!r} not found in {source!r}; available splits: {sorted(obj)}")
        obj = obj[split]
    if not isinstance(obj, datasets.Dataset):
        raise TypeError(f"{source!r} loaded as {type(obj).__name__}, expected a datasets.Dataset")
    return obj


def _normalise_columns(
    ds: datasets.Dataset, source: str, prompt_column: str, answer_column: str | None
) -> datasets.Dataset:
    renames = (("prompt_column", prompt_column, "prompt"), ("answer_column", answer_column, "answer"))
    for role, column, canonical in renames:
        if column is None:
            continue
        if column not in ds.column_names:
            raise ValueError(
                f"{role}={column!r} is not a column of {source!r}; available columns: {ds.column_names}"
            )
        if column != canonical:
            if canonical in ds.column_names:
                raise ValueError(
                    f"{role}={column!r} would be renamed to {canonical!r}, but {source!r} already has a"
                    f" {canonical!r} column; drop or rename it first"
                )
            ds = ds.rename_column(column, canonical)
    if len(ds) == 0:
        raise ValueError(f"dataset {source!r} is empty")
    feature = ds.features["prompt"]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        path = Path(source).expanduser()
        row_problem = _json_problem(path, prompt_column) if path.is_file() else None
        if row_problem:  # the first row that is not a string, by line
            raise ValueError(row_problem)
        raise ValueError(
            f"prompt_column={prompt_column!r} of {source!r} has type {feature}, expected strings"
            " (chat-message lists are not supported; put the user message text in the column)"
        )
    return ds


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, ready for the rollout engine.

    With ``use_chat_template`` each prompt becomes one user turn rendered by the
    tokenizer's chat template with the generation prompt appended (the template
    writes any BOS itself, so no special tokens are added on top), after the
    system turn ``system_prompt`` asks for (``chat_messages``); otherwise the
    raw text is encoded with the tokenizer's own special tokens (e.g. BOS).

    The template is rendered to text and then encoded, rather than calling
    ``apply_chat_template(tokenize=True)``, whose return type changed across
    transformers versions (a list in 4.x, a BatchEncoding in 5.x).

    Returns:
        one list of token ids per prompt, ``len == len(prompts)``.
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not a single string")
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set"
            " `use_chat_template: false` in the data config to encode prompts as plain text"
        )
    if max_prompt_tokens is not None and (not isinstance(max_prompt_tokens, int) or max_prompt_tokens <= 0):
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens!r} must be a positive int or None")
    encoded = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts[{i}] is {type(prompt).__name__}, expected str")
        if use_chat_template:
            ids = _chat_ids(tokenizer, chat_messages(tokenizer, prompt, system_prompt))
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise ValueError(
                f"prompts[{i}] is {len(ids)} tokens, more than max_prompt_tokens={max_prompt_tokens}"
                f" (prompt starts {prompt[:60]!r})"
            )
        encoded.append(list(ids))
    return encoded


def _chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_messages(tokenizer: Any, user: str, system_prompt: str | None) -> list[dict]:
    """The messages a user prompt is rendered from, for a recipe's ``data.system_prompt``.

    * ``None``: the user turn alone; the template decides (SmolLM2's and Qwen2.5's insert
      their default system prompt, ~20-30 tokens of the prompt budget).
    * ``""``: no system text. Whichever of "no system message" and "an empty system
      message" renders shorter: a template that inserts a default when the first message
      is not a system one only skips it for an explicit (empty) system message, while a
      template without a default would render that empty message as an extra turn.
    * any other string: that system message.
    """
    user_turn = [{"role": "user", "content": user}]
    if system_prompt is None:
        return user_turn
    if system_prompt:
        return [{"role": "system", "content": system_prompt}] + user_turn
    empty = [{"role": "system", "content": ""}] + user_turn
    try:
        shorter = len(_chat_ids(tokenizer, empty)) < len(_chat_ids(tokenizer, user_turn))
    except Exception:  # noqa: BLE001 - templates that refuse a system role raise their own error types
        return user_turn
    return empty if shorter else user_turn


def check_prompt_lengths(
    dataset: datasets.Dataset,
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    overlong: str = "error",
    source: str = "<dataset>",
) -> tuple[datasets.Dataset, list[int]]:
    """Every row's prompt measured once, at load time, against ``max_prompt_tokens``.

    Measuring here rather than when a batch is drawn means an over-long prompt cannot
    stop a run at step N with N-1 steps done (and it is named by its dataset row, not by
    its index within a batch). ``overlong``: ``"error"`` raises ``ValueError`` naming the
    first rows that do not fit and their lengths; ``"drop"`` removes them (verl's
    ``data.filter_overlong_prompts``). Returns the dataset kept and the dropped rows.
    """
    if overlong not in ("error", "drop"):
        raise ValueError(f"overlong={overlong!r}: expected 'error' or 'drop'")
    lengths = [len(ids) for ids in encode_prompts(tokenizer, dataset["prompt"], use_chat_template=use_chat_template,
                                                  system_prompt=system_prompt)]
    too_long = [i for i, n in enumerate(lengths) if n > max_prompt_tokens]
    if not too_long:
        return dataset, []
    if overlong == "error":
        shown = ", ".join(f"row {i} ({lengths[i]} tokens)" for i in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        raise ValueError(
            f"data.max_prompt_tokens = {max_prompt_tokens}: {len(too_long)} of {len(lengths)} prompts of {source!r} are"
            f" longer: {shown}{more}; expected every prompt to fit (raise the limit, or set data.overlong_prompts: drop)"
        )
    keep = sorted(set(range(len(lengths))) - set(too_long))
    if not keep:
        raise ValueError(f"data.max_prompt_tokens = {max_prompt_tokens}: every prompt of {source!r} is longer"
                         f" (shortest {min(lengths)} tokens); nothing is left to train on")
    return dataset.select(keep), too_long


def apply_prompt_budget(dataset: datasets.Dataset, tokenizer: Any, data: Any, *, verbose: bool = True) -> datasets.Dataset:
    """``check_prompt_lengths`` with a recipe's ``data`` section; a refusal is a ``RecipeError`` (exit 2)."""
    try:
        kept, dropped = check_prompt_lengths(
            dataset, tokenizer, max_prompt_tokens=data.max_prompt_tokens, use_chat_template=data.use_chat_template,
            system_prompt=data.system_prompt, overlong=data.overlong_prompts, source=data.source)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if dropped and verbose:
        print(f"data.overlong_prompts: drop: {len(dropped)} of {len(dataset)} prompts are longer than"
              f" data.max_prompt_tokens = {data.max_prompt_tokens} and were dropped (first rows: {dropped[:5]})", flush=True)
    return kept


def epoch_seed(seed: int, epoch: int) -> int | str:
    """The seed of ``PromptBatcher``'s order in ``epoch`` of a run seeded ``seed``. Epoch 0 uses ``seed`` itself;
    a later epoch a string of both, which ``random.Random`` hashes (SHA-512), so no two (seed, epoch) pairs share an
    order. ``seed + epoch`` would give seed s + 1 the orders of seed s one epoch later: runs "of different seeds" on a
    fixed pool would share all but one epoch's order, and their spread would understate the noise a comparison across
    seeds must exceed (TRL's RepeatSampler likewise draws each epoch from one generator seeded once per run)."""
    return seed if epoch == 0 else f"prompt-order/{seed}/{epoch}"


class PromptBatcher:
    """Endless, deterministic, resumable stream of prompt batches.

    Epoch ``e`` visits the rows in the order ``random.Random(epoch_seed(seed, e)).shuffle``
    gives and yields ``len(dataset) // batch_size`` full batches; the last
    ``len(dataset) % batch_size`` rows of that order are skipped (a different
    set each epoch), so every batch has exactly ``batch_size`` rows and a
    training step's shapes never change.

    ``state_dict()`` is ``{"epoch", "position", "seed", "batch_size", "num_rows"}``;
    a new batcher over the same dataset that loads it continues with exactly the
    batches the original would have produced next. Loading a state from a
    different seed, batch size or dataset length is refused.
    """

    def __init__(self, dataset: datasets.Dataset | Sequence[dict], batch_size: int, seed: int = 0) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        if len(dataset) < batch_size:
            raise ValueError(f"batch_size={batch_size} is larger than the dataset ({len(dataset)} rows)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into the current epoch's order of the next row to yield
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.dataset)))
            random.Random(epoch_seed(self.seed, self.epoch)).shuffle(order)
            self._order = order
        return self._order

    def __iter__(self) -> Iterator[list[dict]]:
        return self

    def __next__(self) -> list[dict]:
        if self.position + self.batch_size > len(self.dataset):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        indices = self._epoch_order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self._rows(indices)

    def _rows(self, indices: list[int]) -> list[dict]:
        if isinstance(self.dataset, datasets.Dataset):
            columns = self.dataset[indices]  # one columnar read instead of batch_size row reads
            return [{k: v[j] for k, v in columns.items()} for j in range(len(indices))]
        return [dict(self.dataset[i]) for i in indices]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        expected = {"epoch", "position", "seed", "batch_size", "num_rows"}
        if set(state) != expected:
            raise ValueError(f"PromptBatcher state has keys {sorted(state)}, expected {sorted(expected)}")
        mine = {"seed": self.seed, "batch_size": self.batch_size, "num_rows": len(self.dataset)}
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(
                    f"cannot resume: saved {key}={state[key]!r} but this batcher has {key}={value!r};"
                    " resuming must use the same dataset, batch size and seed"
                )
        if not (isinstance(state["epoch"], int) and state["epoch"] >= 0):
            raise ValueError(f"PromptBatcher state epoch={state['epoch']!r} must be an int >= 0")
        if not (isinstance(state["position"], int) and 0 <= state["position"] <= len(self.dataset)):
            raise ValueError(
                f"PromptBatcher state position={state['position']!r} must be an int in [0, {len(self.dataset)}]"
            )
        self.epoch, self.position, self._order = state["epoch"], state["position"], None
