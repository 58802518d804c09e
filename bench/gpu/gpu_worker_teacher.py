"""torchrun worker of bench/gpu/gpu_rows_teacher_doctor.py (issue 57 item 2): every rank starts the same teacher
server's client, as training's setup does (``Teacher.from_config``, ``teacher.engine: server``), and scores the same
sequences.

Each rank joins a gloo group (the trainer's CPU collectives; ``DataParallel.current``) with CUDA visible, so the
teacher's client takes its CUDA paths; the ranks' log-probs are gathered and each rank writes OUT_DIR/rank_<r>.json:
its rank, whether its client opened a weight transfer, and the log-probs.

argv: OUT_DIR SERVER_URL.
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "trainer" / "distributed")]

import torch.distributed as dist  # noqa: E402
from worker_exit import finish  # noqa: E402

from trainer.builtin.resolve import resolve_model_path  # noqa: E402
from trainer.distributed.data_parallel import DataParallel  # noqa: E402
from trainer.lifecycle.preflight import load_recipe  # noqa: E402
from trainer.teacher.teacher import Teacher  # noqa: E402

SEQUENCES = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]


def main(out_dir: Path, url: str) -> None:
    dist.init_process_group("gloo")
    dp = DataParallel.current()
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml",
                      ["algorithm.distill_coef=0.1", "teacher.path=builtin:tiny", "teacher.engine=server",
                       f"teacher.server_url={url}", "teacher.server_timeout_s=240", f"logging.run_dir={out_dir}/run"])
    teacher = Teacher.from_config(cfg, resolve_model_path("builtin:tiny"), dp=dp, device="cpu", max_model_len=64)
    try:
        scored = teacher.engine.score(SEQUENCES)
        result = {"rank": dp.rank, "transfer": teacher.engine._transfer is not None, "logprobs": scored.logprobs}
        dp.barrier()
    finally:
        teacher.close()
    (out_dir / f"rank_{dp.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    finish()
