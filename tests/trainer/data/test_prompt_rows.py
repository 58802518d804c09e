"""Every row's prompt checked when a local dataset loads: a null, a missing key, a number or a list is named by
file and line; a JSON file that is not UTF-8 by file, byte and line (Arrow would load it and fail mid-run)."""
import pytest

from trainer.data.datasets import load_prompt_dataset


def rows(*prompts: str) -> str:
    return "".join(f'{{"prompt": {p}, "answer": "{i}"}}\n' for i, p in enumerate(prompts))


def refusal(path, **kw) -> str:
    with pytest.raises(ValueError) as e:
        load_prompt_dataset(str(path), **kw)
    return str(e.value)


def test_a_null_prompt_is_named_by_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(rows('"a"', '"b"') + "\n" + rows("null"))  # a blank line: the null row is on line 4
    assert refusal(p) == f"{p}:4: prompt is null (or missing); expected strings (one in every row)"


def test_a_row_without_the_prompt_key(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(rows('"a"') + '{"answer": "1"}\n')
    assert refusal(p).startswith(f"{p}:2: prompt is null (or missing)")


def test_a_renamed_prompt_column_is_named_as_the_file_spells_it(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"q": "a", "answer": "1"}\n{"q": null, "answer": "2"}\n')
    assert refusal(p, prompt_column="q").startswith(f"{p}:2: q is null (or missing)")


def test_nulls_outside_the_selected_rows_do_not_matter(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(rows('"a"', '"b"', "null"))
    assert load_prompt_dataset(str(p), num_examples=2)["prompt"][:] == ["a", "b"]


@pytest.mark.parametrize("value,shown", [("5", "5 (int)"), ('["x"]', '["x"] (list)')])
def test_a_prompt_of_another_type_among_strings(tmp_path, value, shown):
    p = tmp_path / "d.jsonl"
    p.write_text(rows('"a"', value, '"c"'))
    assert refusal(p).startswith(f"{p}:2: prompt is {shown}; expected strings"), refusal(p)


def test_a_json_array_file_names_the_row(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[{"prompt": "a", "answer": "1"}, {"prompt": 3, "answer": "2"}]')
    assert refusal(p).startswith(f"{p}: row 1: prompt is 3 (int)")


def test_a_jsonl_that_is_not_utf8_is_named_by_byte_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    first = rows('"a"').encode()
    p.write_bytes(first + b'{"prompt": "caf\xe9", "answer": "2"}\n')
    # the bad byte: after the first line, then '{"prompt": "caf' (15 bytes)
    assert refusal(p) == (f"{p}: byte {len(first) + 15} (line 2, column 16) is 0xe9, not UTF-8: expected a UTF-8 "
                          "text file")


def test_a_large_jsonl_that_is_not_utf8_is_refused_too(tmp_path):
    # over 1 KiB: past the empty-file shortcut, so Arrow would load it and fail when the row is read
    p = tmp_path / "d.jsonl"
    body = rows(*[f'"q{i}"' for i in range(60)]).encode()
    p.write_bytes(body + b'{"prompt": "\xff", "answer": "2"}\n')
    assert refusal(p).startswith(f"{p}: byte {len(body) + 12} (line 61, column 13) is 0xff")


def test_a_utf16_jsonl_is_named_as_such(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(rows('"a"'), encoding="utf-16")
    assert "UTF-16 byte-order mark" in refusal(p)
