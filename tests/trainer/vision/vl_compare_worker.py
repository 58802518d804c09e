"""Worker for tests/trainer/vision/test_vl_compare.py: ``parityrl compare --image-column image`` on the random tiny
Idefics3 (std 0.2 weights, float32) through the command line, healthy and with each input fault of vl_faults.py
planted (the trainer's processor at other pixels, one prompt's image dropped from the engine's request). Each run
starts its own vLLM engine, as the command does, in a process of its own (the test session already holds a text
engine, tests/conftest.py). Prints one JSON line per run: its exit status, its summary (when written) and the
command's error line.

Usage: python vl_compare_worker.py <out-dir-root>
"""
import contextlib
import io
import json
import sys
from pathlib import Path

from vl_faults import engine_drops_an_image, processor_at_42_pixels

from trainer.cli import main as cli
from trainer.data.datasets import load_prompt_dataset


def prompts_file(root: Path) -> Path:
    """Four shapes prompts, each image a PNG file the column names; the last one without an image."""
    data = load_prompt_dataset("builtin:shapes", num_examples=4, answer_column=None)
    rows = []
    for i in range(4):
        image = root / f"shapes_{i}.png"
        data[i]["image"].save(image)
        rows.append({"prompt": data[i]["prompt"], "image": str(image) if i < 3 else None})
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(root: str) -> None:
    root = Path(root)
    prompts = prompts_file(root)
    for name, plant in (("healthy", None), ("processor_42px", processor_at_42_pixels),
                        ("image_dropped", engine_drops_an_image)):
        out = root / name
        undo = plant() if plant else None
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                status = cli(["compare", "builtin:zoo-idefics3", str(prompts), "--out", str(out), "--dtype", "float32",
                              "--image-column", "image", "--max-new-tokens", "8", "-n", "2"])
        finally:
            if undo:
                undo()
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
        error = [line for line in err.getvalue().splitlines() if line.startswith("parityrl compare:")]
        print("RESULT " + json.dumps({"run": name, "status": status, "summary": summary, "error": error}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
