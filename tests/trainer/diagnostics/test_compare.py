"""`parityrl compare`: inputs, the report files, and the two end-to-end comparisons.

HF-vs-HF in self-check mode must give exactly zero error (the two sides are one
computation, so any misalignment in the pipeline would show); vLLM-vs-HF on the tiny
model must stay within the suite's bound (mae < 1e-2). The vLLM test reuses the
session engine: a second in-process vLLM engine would break vLLM's distributed state.
"""
import dataclasses
import json
import math

import pytest
import torch

from parity.report import REPORT_FILES, pick_longest, pick_typical, prepare_out_dir, write_report
from trainer.cli import main, parse_bytes
from trainer.diagnostics.compare import run_compare
from trainer.diagnostics.compare_inputs import CompareError, load_image_column, load_prompts
from trainer.diagnostics.compare_report import SELF_CHECK_EXPECTED, self_check_result

PROMPTS = ["What is 12 + 7?", "Tom has 4 pens and finds 3 more. How many pens does Tom have?", "What is 9 - 5?"]
SHEETS = {"summary", "longest", "typical"}


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": x, "answer": "0"}) + "\n" for x in PROMPTS))
    return p


def read_report(out):
    summary = json.loads((out / "summary.json").read_text())
    tokens = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return summary, tokens, samples


def check_report_files(out, summary, tokens, samples):
    """What every report must satisfy, whatever the engine."""
    from openpyxl import load_workbook
    from PIL import Image

    assert all((out / name).is_file() for name in REPORT_FILES)
    assert len(tokens) == summary["num_tokens"] == summary["metrics"]["parity/num_tokens"] > 0
    assert len(samples) == summary["num_samples"] == summary["num_prompts"] * summary["settings"]["n"]
    for t in tokens:  # the diff column is exactly trainer - engine (float64 of the float32 values)
        assert t["diff"] == t["trainer_logprob"] - t["engine_logprob"]
        assert t["prompt"] == t["sample"] // summary["settings"]["n"]
    for s in samples:  # every sample's tokens, positions 0..L-1 in order
        assert [t["position"] for t in tokens if t["sample"] == s["sample"]] == list(range(s["num_tokens"]))
    assert SHEETS <= set(load_workbook(out / "report.xlsx", read_only=True).sheetnames)
    for name in REPORT_FILES:
        if name.endswith(".png"):
            with Image.open(out / name) as img:
                img.verify()
                assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100


# ----------------------------------------------------------------------------------
# Inputs (fast)
# ----------------------------------------------------------------------------------


def test_txt_prompts_one_per_line_blank_lines_skipped(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("first prompt\n\n  \nsecond: {json-like} text\nthird\n")
    assert load_prompts(p) == ["first prompt", "second: {json-like} text", "third"]
    assert load_prompts(p, num_prompts=2) == ["first prompt", "second: {json-like} text"]


def test_jsonl_prompts_with_another_column_name(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"question": "a?"}\n{"question": "b?"}\n')
    assert load_prompts(p, prompt_column="question") == ["a?", "b?"]


@pytest.mark.parametrize("name, text, expected", [
    ("missing.jsonl", None, "does not exist"),
    ("p.csv", "prompt\nx\n", "unsupported suffix '.csv'"),
    ("p.txt", "\n \n", "holds no prompts"),
    ("p.jsonl", "", "is empty"),
    ("p.jsonl", '{"question": "a?"}\n', "prompt_column='prompt' is not a column"),
    ("p.jsonl", '{"prompt": "a?"}\n{"prompt": "  "}\n', "row 1 column 'prompt' = '  '; expected a non-empty string"),
])
def test_bad_prompt_files_name_the_file_and_the_problem(tmp_path, name, text, expected):
    p = tmp_path / name
    if text is not None:
        p.write_text(text)
    with pytest.raises(CompareError) as err:
        load_prompts(p)
    assert expected in str(err.value) and str(p) in str(err.value)


def test_cli_bad_prompt_file_exits_2_before_writing(tmp_path, tiny_model_dir, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"question": "a?"}\n')
    out = tmp_path / "report"
    assert main(["compare", tiny_model_dir, str(bad), "--out", str(out), "--engine", "hf"]) == 2
    err = capsys.readouterr().err
    assert "parityrl compare:" in err and str(bad) in err and "'prompt'" in err
    assert not out.exists()


def test_cli_refuses_a_non_empty_out_dir(tmp_path, tiny_model_dir, prompt_file, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "summary.json").write_text("{\"earlier\": true}")
    assert main(["compare", tiny_model_dir, str(prompt_file), "--out", str(out), "--engine", "hf"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == "{\"earlier\": true}" and len(list(out.iterdir())) == 1


def test_bad_sampling_settings_and_a_bad_model_are_refused(tmp_path, prompt_file, tiny_model_dir):
    for kwargs, expected in (({"top_p": 1.5}, "top_p = 1.5"), ({"top_k": 1}, "top_k = 1"), ({"min_p": -0.1}, "min_p"),
                             ({"temperature": 0.0}, "temperature = 0.0"), ({"engine": "sglang"}, "engine = 'sglang'")):
        with pytest.raises(CompareError, match=expected):
            run_compare(tiny_model_dir, prompt_file, tmp_path / "r", **kwargs)
    with pytest.raises(CompareError, match="config.json"):
        run_compare(str(tmp_path), prompt_file, tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_images_are_refused_where_they_cannot_run(tmp_path, prompt_file, tiny_model_dir):
    for kwargs, expected in (({"engine": "hf"}, "the HF engine takes no images"),
                             ({"adapter": str(tmp_path)}, "adapter with image_column: not built yet"),
                             ({"use_chat_template": False}, "use_chat_template = False with image_column")):
        with pytest.raises(CompareError, match=expected):
            run_compare(tiny_model_dir, prompt_file, tmp_path / "r", image_column="image", **kwargs)
    with pytest.raises(CompareError, match="is a text-only model"):
        run_compare(tiny_model_dir, prompt_file, tmp_path / "r", image_column="image")
    assert not (tmp_path / "r").exists()


def test_an_image_column_is_read_from_the_prompts_file(tmp_path, prompt_file):
    assert load_image_column(prompt_file, image_column="answer", num_prompts=2) == ["0", "0"]
    with pytest.raises(CompareError, match="'image': prompts file .* has no such column; its columns"):
        load_image_column(prompt_file, image_column="image")
    txt = tmp_path / "prompts.txt"
    txt.write_text("What is 1 + 1?\n")
    with pytest.raises(CompareError, match="a .txt file, which holds no columns"):
        load_image_column(txt, image_column="image")


def test_parse_bytes():
    assert parse_bytes("268435456") == 256 * 2**20 == parse_bytes("256MiB") == parse_bytes("0.25 GiB")
    with pytest.raises(Exception, match="256XB"):
        parse_bytes("256XB")


# ----------------------------------------------------------------------------------
# Report writer and helpers (fast, synthetic rows)
# ----------------------------------------------------------------------------------


def test_self_check_result_is_exact():
    exact = dict(SELF_CHECK_EXPECTED, **{"parity/num_tokens": 5.0})
    assert self_check_result(exact)["passed"]
    off = dict(exact, **{"parity/mae": 1e-12})
    assert self_check_result(off) == {"passed": False, "mismatches": {"parity/mae": 1e-12}, "missing": [],
                                      "unchecked": []}
    assert not self_check_result({"parity/num_tokens": 0.0})["passed"]  # nothing compared is not a pass


def test_longest_and_typical_pick():
    samples = [{"sample": i, "num_tokens": n} for i, n in enumerate([3, 10, 5, 5, 9, 1, 5])]
    assert [s["sample"] for s in pick_longest(samples, 2)] == [1, 4]
    # median length 5: samples 2, 3, 6 have it exactly
    assert [s["sample"] for s in pick_typical(samples, 2, exclude=[2])] == [3, 6]
    assert [s["sample"] for s in pick_typical(samples[:2], 2, exclude=[0, 1])] == [0, 1]  # too few: overlap


def test_write_report_from_plain_rows(tmp_path):
    from openpyxl import load_workbook

    tokens = [{"sample": s, "prompt": 0, "position": p, "token_id": 7, "token": "\x1b[x" if p == 0 else "ab",
               "engine_logprob": -0.5 - p, "trainer_logprob": -0.5 - p + 0.01 * s, "diff": 0.01 * s,
               "trainer_entropy": 1.0} for s in range(2) for p in range(3)]
    samples = [{"sample": s, "prompt": 0, "num_tokens": 3, "finish_reason": "length", "mae": 0.01 * s,
                "seq_log_ratio": 0.03 * s, "prompt_text": "q", "completion_text": "\x00ab"} for s in range(2)]
    per_position = [{"position_start": p, "position_end": p + 1, "num_tokens": 2, "mean_abs_d": 0.005,
                     "mean_d": 0.005} for p in range(3)]
    summary = {"num_tokens": 6, "settings": {"engine": "fake"}, "metrics": {"parity/mae": 0.005},
               "breakdowns": {"by_entropy": [{"entropy_start": 4.0, "entropy_end": math.inf, "num_tokens": 6}]}}
    out = prepare_out_dir(tmp_path / "r")
    write_report(out, summary=summary, tokens=tokens, samples=samples, per_position=per_position, num_examples=1)
    written = json.loads((out / "summary.json").read_text())  # strict JSON: inf became null
    assert written["breakdowns"]["by_entropy"][0]["entropy_end"] is None
    wb = load_workbook(out / "report.xlsx")
    assert wb.sheetnames == ["summary", "longest", "typical", "by_entropy"]
    assert ("metrics.parity/mae", 0.005) in list(wb["summary"].iter_rows(values_only=True))
    cells = [c for row in wb["longest"].iter_rows(values_only=True) for c in row if isinstance(c, str)]
    assert "\\x1b[x" in cells and "\\x00ab" in cells  # control characters escaped, not dropped


# ----------------------------------------------------------------------------------
# End to end (slow: models run)
# ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_hf_vs_hf_self_check_is_exactly_zero(tmp_path, tiny_model_dir, prompt_file):
    out = tmp_path / "report"
    summary = run_compare(tiny_model_dir, prompt_file, out, engine="hf", n=2, max_new_tokens=16, seed=3,
                          self_check=True, batch_size=4, topk=3)
    assert summary["self_check_result"]["passed"], summary["self_check_result"]
    m = summary["metrics"]
    for key, value in SELF_CHECK_EXPECTED.items():
        assert m[key] == value, key
    assert m["parity/topk_kl"] == 0.0  # the top-k side goes through the same scoring
    saved, tokens, samples = read_report(out)
    check_report_files(out, saved, tokens, samples)
    assert saved["metrics"] == m and saved["chat_template"]["used"] is True
    assert saved["chat_template"]["sha256"] and "{%" in saved["chat_template"]["text"]
    assert all(t["diff"] == 0.0 for t in tokens)
    assert {"by_position", "by_rollout_prob", "by_entropy", "worst_tokens"} <= saved["breakdowns"].keys()


@pytest.mark.slow
def test_self_check_catches_a_one_position_shift(tmp_path, tiny_model_dir, prompt_file, monkeypatch):
    """The check can fail: engine-side log-probs shifted by one token must give non-zero error."""
    import trainer.diagnostics.compare as cmp

    honest = cmp.self_check_rollouts

    def shifted(rollouts, lp, top):
        r = honest(rollouts, lp, top)
        return dataclasses.replace(r, rollout_logprobs=[x[1:] + x[:1] for x in r.rollout_logprobs])

    monkeypatch.setattr(cmp, "self_check_rollouts", shifted)
    summary = run_compare(tiny_model_dir, prompt_file, tmp_path / "r", engine="hf", max_new_tokens=16,
                          self_check=True)
    assert not summary["self_check_result"]["passed"]
    assert summary["metrics"]["parity/mae"] > 1e-3


@pytest.mark.slow
def test_vllm_vs_hf_on_the_tiny_model(tmp_path, tiny_model_dir, prompt_file, vllm_engine):
    from transformers import AutoModelForCausalLM

    from rollout.weight_export import full_weights

    # Other tests train through the session engine; compare it with the model on disk.
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    vllm_engine.load_weights(full_weights(ref, dtype=torch.bfloat16))
    out = tmp_path / "report"
    summary = run_compare(tiny_model_dir, prompt_file, out, engine=vllm_engine, n=2, max_new_tokens=16, seed=1,
                          topk=5)
    m = summary["metrics"]
    assert summary["settings"]["engine"] == "VLLMEngine" and "self_check_result" not in summary
    assert m["parity/mae"] < 1e-2 and m["parity/pearson"] > 0.99 and m["parity/kl_k3"] < 1e-3
    # top-5 + rest bucket KL, a lower bound on the full KL (bound as in tests/rollout/test_vllm_engine.py)
    assert 0 <= m["parity/topk_kl"] < 3e-3
    saved, tokens, samples = read_report(out)
    check_report_files(out, saved, tokens, samples)
    assert vllm_engine.llm is not None  # a given engine is left open for its owner


@pytest.mark.slow
def test_cli_hf_self_check_then_overwrite(tmp_path, tiny_model_dir, prompt_file, capsys):
    out = tmp_path / "report"
    args = ["compare", tiny_model_dir, str(prompt_file), "--out", str(out), "--engine", "hf", "--self-check",
            "--max-new-tokens", "12", "-n", "2", "--num-prompts", "2", "--chat-template", "off"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "self-check passed" in printed and str(out) in printed
    summary, tokens, samples = read_report(out)
    check_report_files(out, summary, tokens, samples)
    assert summary["num_prompts"] == 2 and summary["chat_template"]["used"] is False
    (out / "notes.txt").write_text("mine")
    assert main(args) == 2  # an earlier report is never replaced silently
    assert json.loads((out / "summary.json").read_text())["created"] == summary["created"]
    assert main(args + ["--overwrite", "--seed", "5"]) == 0
    assert (out / "notes.txt").read_text() == "mine"  # only the report's own files are replaced
    assert json.loads((out / "summary.json").read_text())["settings"]["seed"] == 5
