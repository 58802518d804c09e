"""Tests for trainer/data/datasets.py: dataset loading, prompt encoding and the resumable batcher."""

from __future__ import annotations

import copy
import json
import re

import datasets
import pytest

from trainer.builtin import tiny
from trainer.data import datasets as data
from trainer.data.datasets import PromptBatcher, encode_prompts, load_prompt_dataset
from trainer.data.tasks.arithmetic import arithmetic_dataset

ROWS = [
    {"question": "What is 1 + 1?", "solution": "2", "level": 1},
    {"question": "What is 2 + 3?", "solution": "5", "level": 2},
    {"question": "What is 4 - 4?", "solution": "0", "level": 1},
]


# ------------------------------------------------------------------ sources


def test_builtin_source():
    ds = load_prompt_dataset("builtin:arithmetic", num_examples=7, seed=5, builtin_kwargs={"max_operand": 9})
    assert ds.to_list() == arithmetic_dataset(7, seed=5, max_operand=9).to_list()
    test = load_prompt_dataset("builtin:arithmetic", split="test", num_examples=4)
    assert test.to_list() == arithmetic_dataset(4, split="test").to_list()


def test_builtin_default_size():
    assert len(load_prompt_dataset("builtin:arithmetic")) == 2000
    assert len(load_prompt_dataset("builtin:arithmetic", split="test")) == 200


def test_jsonl_renames_columns_and_keeps_others(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ds = load_prompt_dataset(str(path), prompt_column="question", answer_column="solution")
    assert sorted(ds.column_names) == ["answer", "level", "prompt"]
    assert ds["prompt"] == [r["question"] for r in ROWS]
    assert ds["answer"] == ["2", "5", "0"]
    assert ds["level"] == [1, 2, 1]


def test_json_list_and_first_n(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": r["question"], "answer": r["solution"]} for r in ROWS]))
    ds = load_prompt_dataset(str(path), num_examples=2)
    assert ds["prompt"] == ["What is 1 + 1?", "What is 2 + 3?"]


def test_num_examples_larger_than_file_warns(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    with pytest.warns(UserWarning, match="num_examples=5 but .* has only 2 rows"):
        ds = load_prompt_dataset(str(path), answer_column=None, num_examples=5)
    assert ds.column_names == ["prompt"] and len(ds) == 2


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    ds = load_prompt_dataset(str(path), prompt_column="question", answer_column=None)
    assert ds["prompt"] == [r["question"] for r in ROWS]
    assert sorted(ds.column_names) == ["level", "prompt", "solution"]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    single = datasets.Dataset.from_list(ROWS)
    single.save_to_disk(str(tmp_path / "single"))
    ds = load_prompt_dataset(str(tmp_path / "single"), prompt_column="question", answer_column="solution")
    assert ds["answer"] == ["2", "5", "0"]

    dd = datasets.DatasetDict({"train": single, "test": single.select([2])})
    dd.save_to_disk(str(tmp_path / "dict"))
    test = load_prompt_dataset(str(tmp_path / "dict"), split="test", prompt_column="question", answer_column=None)
    assert test["prompt"] == ["What is 4 - 4?"]
    message = re.escape("split='validation' not found in") + ".*" + re.escape("available splits: ['test', 'train']")
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(str(tmp_path / "dict"), split="validation", prompt_column="question")


def test_hub_id_goes_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(source, split=None):
        calls.append((source, split))
        return datasets.Dataset.from_list([{"prompt": "p", "answer": "1"}])

    monkeypatch.setattr(data.datasets, "load_dataset", fake_load_dataset)
    ds = load_prompt_dataset("some-org/some-dataset", split="test")
    assert calls == [("some-org/some-dataset", "test")]
    assert ds.to_list() == [{"prompt": "p", "answer": "1"}]


# ------------------------------------------------------------------ errors


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(f"dataset file {str(missing)!r} does not exist")):
        load_prompt_dataset(str(missing))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset("./relative/missing_dir")


def test_unsupported_extension(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt\nhi\n")
    message = re.escape("unsupported dataset file extension '.csv'") + ".*" + re.escape("['.json', '.jsonl', '.parquet']")
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(str(path))


def test_missing_column_lists_available(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    message = re.escape("prompt_column='prompt' is not a column of") + ".*"
    message += re.escape("available columns: ['question', 'solution', 'level']")
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(str(path))
    with pytest.raises(ValueError, match=re.escape("answer_column='answer' is not a column")):
        load_prompt_dataset(str(path), prompt_column="question")


def test_rename_conflict(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "question": "b"}) + "\n")
    with pytest.raises(ValueError, match="already has a 'prompt' column"):
        load_prompt_dataset(str(path), prompt_column="question", answer_column=None)


def test_empty_dataset(tmp_path):
    empty = datasets.Dataset.from_dict(
        {"prompt": [], "answer": []},
        features=datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string")}),
    )
    empty.save_to_disk(str(tmp_path / "empty"))
    empty.to_parquet(str(tmp_path / "empty.parquet"))
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "empty.json").write_text("[]")
    for name in ("empty", "empty.parquet", "empty.jsonl", "empty.json"):
        with pytest.raises(ValueError, match=re.escape(f"dataset {str(tmp_path / name)!r} is empty")):
            load_prompt_dataset(str(tmp_path / name))
    # Rows that exist but are all filtered away by the caller are caught after loading too.
    with pytest.raises(ValueError, match="is empty"):
        data._normalise_columns(empty, "mem", "prompt", "answer")


def test_non_string_prompts(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="expected strings"):
        load_prompt_dataset(str(path), answer_column=None)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown builtin dataset 'builtin:algebra'.*builtin:arithmetic"):
        load_prompt_dataset("builtin:algebra")
    with pytest.raises(ValueError, match="num_examples=0 must be a positive int"):
        load_prompt_dataset("builtin:arithmetic", num_examples=0)
    with pytest.raises(ValueError, match="builtin_kwargs=.* is only valid with a builtin: source"):
        load_prompt_dataset("x.jsonl", builtin_kwargs={"max_operand": 3})


# ------------------------------------------------------------------ encode_prompts


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.build_tiny_base(tmp_path_factory.mktemp("tiny") / "base"))


def test_encode_with_chat_template(tok):
    ids = encode_prompts(tok, ["Tom has 3 apples.", "Hi"])
    # <|bos|>=1 <|user|>=3 ... <|end|>=2 <|assistant|>=4 around the plain encoding
    assert ids[0] == [1, 3] + tok("Tom has 3 apples.")["input_ids"] + [2, 4]
    assert tok.convert_ids_to_tokens(ids[0]) == [
        "<|bos|>", "<|user|>", "Tom", "Ġhas", "Ġ3", "Ġapples", ".", "<|end|>", "<|assistant|>"
    ]  # fmt: skip
    assert ids[1][:2] == [1, 3] and ids[1][-2:] == [2, 4]


def test_encode_plain(tok):
    # The tiny tokenizer adds no special tokens of its own.
    assert encode_prompts(tok, ["Tom has 3 apples."], use_chat_template=False) == [
        tok("Tom has 3 apples.", add_special_tokens=False)["input_ids"]
    ]


def test_encode_max_prompt_tokens(tok):
    assert len(encode_prompts(tok, ["Tom has 3 apples."], max_prompt_tokens=9)[0]) == 9
    with pytest.raises(ValueError, match=r"prompts\[1\] is 9 tokens, more than max_prompt_tokens=8"):
        encode_prompts(tok, ["Hi", "Tom has 3 apples."], max_prompt_tokens=8)


def test_encode_without_chat_template(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="has no chat template; set `use_chat_template: false`"):
        encode_prompts(plain, ["Hi"])
    assert encode_prompts(plain, ["Hi"], use_chat_template=False) == [tok("Hi")["input_ids"]]


def test_encode_bad_input(tok):
    with pytest.raises(TypeError, match="not a single string"):
        encode_prompts(tok, "Hi")
    with pytest.raises(TypeError, match=r"prompts\[1\] is int, expected str"):
        encode_prompts(tok, ["Hi", 3])


# ------------------------------------------------------------------ PromptBatcher


def _ids(batch):
    return [row["i"] for row in batch]


@pytest.fixture
def numbered():
    return datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(10)], "i": list(range(10))})


def test_batcher_epochs_are_seeded_permutations(numbered):
    import random

    batcher = PromptBatcher(numbered, batch_size=3, seed=7)
    batches = [_ids(next(batcher)) for _ in range(6)]
    order0, order1, order2 = list(range(10)), list(range(10)), list(range(10))
    random.Random(7).shuffle(order0)  # epoch 0 uses the seed
    random.Random("prompt-order/7/1").shuffle(order1)  # later epochs a string of seed and epoch
    random.Random("prompt-order/7/2").shuffle(order2)
    # 10 // 3 = 3 full batches per epoch; the 10th row of each order is skipped.
    assert batches == [order0[0:3], order0[3:6], order0[6:9], order1[0:3], order1[3:6], order1[6:9]]
    assert len(numbered) // batcher.batch_size == 3
    # Rows come back whole, every column included.
    assert next(batcher) == [{"prompt": f"p{j}", "i": j} for j in order2[0:3]]
    assert batcher.state_dict() == {"epoch": 2, "position": 3, "seed": 7, "batch_size": 3, "num_rows": 10}


def test_batcher_seeds_share_no_epoch_order(numbered):
    # 10! orders of 10 rows: two seeds' epochs agreeing would be a shared stream, not chance.
    def epochs(seed):
        batcher = PromptBatcher(numbered, batch_size=10, seed=seed)
        return [tuple(_ids(next(batcher))) for _ in range(6)]

    orders = [order for seed in range(5) for order in epochs(seed)]
    assert len(set(orders)) == len(orders)


def test_batcher_same_seed_same_stream(numbered):
    a, b = PromptBatcher(numbered, 4, seed=1), PromptBatcher(numbered, 4, seed=1)
    stream = [_ids(next(a)) for _ in range(9)]
    assert stream == [_ids(next(b)) for _ in range(9)]
    c = PromptBatcher(numbered, 4, seed=2)
    assert stream != [_ids(next(c)) for _ in range(9)]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])  # resume mid-epoch, at a boundary, in a later epoch
def test_batcher_resume_equals_uninterrupted(numbered, k):
    uninterrupted = PromptBatcher(numbered, 3, seed=11)
    expected = [_ids(next(uninterrupted)) for _ in range(k + 5)]

    first = PromptBatcher(numbered, 3, seed=11)
    head = [_ids(next(first)) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptBatcher(numbered, 3, seed=11)
    resumed.load_state_dict(state)
    assert head + [_ids(next(resumed)) for _ in range(5)] == expected


def test_batcher_over_list_of_dicts():
    rows = [{"prompt": f"p{i}", "i": i} for i in range(4)]
    batch = next(PromptBatcher(rows, 4, seed=0))
    assert sorted(_ids(batch)) == [0, 1, 2, 3]


def test_batcher_errors(numbered):
    with pytest.raises(ValueError, match="batch_size=0 must be a positive int"):
        PromptBatcher(numbered, 0)
    with pytest.raises(ValueError, match=r"batch_size=11 is larger than the dataset \(10 rows\)"):
        PromptBatcher(numbered, 11)
    state = PromptBatcher(numbered, 3, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved seed=1 but this batcher has seed=2"):
        PromptBatcher(numbered, 3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved num_rows=10 but this batcher has num_rows=9"):
        PromptBatcher(numbered.select(range(9)), 3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="has keys"):
        PromptBatcher(numbered, 3, seed=1).load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=r"position=12 must be an int in \[0, 10\]"):
        PromptBatcher(numbered, 3, seed=1).load_state_dict({**state, "position": 12})
