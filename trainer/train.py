"""Entry point for `accelerate launch -m trainer.train <recipe.yaml> [--set key=value ...] [--resume]`."""
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from trainer.cli import quiet_third_party, run_train

    quiet_third_party()

    sys.exit(run_train(prog="trainer.train"))
