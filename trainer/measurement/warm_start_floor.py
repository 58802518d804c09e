"""The floor a warm-started built-in model must reach before it is cached: its held-out greedy accuracy on the task
it was built for, measured as the RL recipe that trains it measures ``eval/greedy``.

A warm start is a short supervised run whose outcome depends on the host's rounding (a 200-step build of
``builtin:tiny-tools`` has come out at held-out greedy 0.78 on one x86 host and 0.20 on another, same commit): a
build below its floor would hand RL a model that the demo then unlearns. So every build is judged here before it
is moved into the cache, and one below its floor fails with one line naming the figure, the floor and the recipe.
``trainer.builtin.warm_start`` runs this module in a child process (``python -m trainer.measurement.warm_start_floor
NAME MODEL_DIR RECIPE FLOOR``): the build sits below the evaluation in the package order, and the child frees the
evaluation's model when it exits. The child's stdout's last line is the figure; below the floor it exits with
``BelowFloor.exit_status`` and the one line on stderr.

Measured with the recipe's own held-out rows, reward functions and episodes (``Evaluator``, ``Sampler`` /
``EpisodeSampler``) on the Hugging Face engine in float32: the judgement is of the model, not of one engine's
half-precision kernels on one ISA, and needs no vLLM engine (a build runs before any). A vision-language recipe's
rows hold images, which the Hugging Face engine does not take: those are judged on vLLM in float32, started in this
child process and closed with it.
"""
from __future__ import annotations

import sys
from pathlib import Path

from rollout.hf_engine import HFEngine
from trainer.builtin.warm_start import BelowFloor
from trainer.config import read_recipe
from trainer.config.validate import sequence_length
from trainer.distributed.data_parallel import DataParallel
from trainer.environments.episode_environment import EpisodeEnvironment
from trainer.measurement.evaluation import Evaluator
from trainer.models.policy import load_tokenizer
from trainer.rewards.sources import build_reward_sources
from trainer.sampling.engines import make_engine
from trainer.sampling.episode_sampler import sampler_for
from trainer.vision.prompts import vision_prompts

EVAL_DTYPE = "float32"


def held_out_greedy(recipe: Path, model_dir: Path) -> float:
    """``eval/greedy`` of the model in ``model_dir`` on ``recipe``'s held-out rows (its ``eval.num_prompts``)."""
    images = read_recipe(recipe, []).data.image_column is not None
    # images: vLLM (the Hugging Face engine takes no images), in float32 too, the weights served as they are
    engine_sets = ["rollout.lora_sync=merged"] if images else ["rollout.engine=hf"]
    cfg = read_recipe(recipe, [f"model.path={model_dir}", *engine_sets, "eval.samples=0", "eval.greedy=true",
                               f"model.dtype={EVAL_DTYPE}", "logging.wandb.mode=disabled"])
    tokenizer = load_tokenizer(str(model_dir))
    dp = DataParallel()
    evaluator = Evaluator.from_config(cfg, dp, tokenizer, train_rows=[])
    reward_fns, _ = build_reward_sources(cfg.reward, "cpu")
    if images:
        engine = make_engine(cfg, str(model_dir), max_model_len=sequence_length(cfg))
    else:
        engine = HFEngine(str(model_dir), dtype=EVAL_DTYPE, device="cpu")
    environment = EpisodeEnvironment.from_config(cfg, str(recipe)) if cfg.env.enabled else None
    sampler = sampler_for(environment, cfg=cfg, engine=engine, batcher=None, tokenizer=tokenizer,
                          reward_fns=reward_fns, dp=dp, vision=vision_prompts(cfg, str(model_dir)))
    try:
        return evaluator(sampler, model=None, step=0)["eval/greedy"]
    finally:
        engine.close()


def check_floor(name: str, model_dir: Path, recipe: Path, floor: float) -> float:
    """The build's held-out greedy accuracy on ``recipe``'s rows; ``BelowFloor`` (one line) when under ``floor``."""
    got = held_out_greedy(recipe, model_dir)
    if got < floor:
        raise BelowFloor(f"{name}: the warm start came out at held-out greedy accuracy {got:.3f}, below its floor "
                         f"{floor:.2f} ({recipe.name}'s eval rows); not cached. The build is deterministic per "
                         "host: report this line with the host's CPU (lscpu)")
    return got


if __name__ == "__main__":
    _name, _model_dir, _recipe, _floor = sys.argv[1:5]
    try:
        print(check_floor(_name, Path(_model_dir), Path(_recipe), float(_floor)), flush=True)
    except BelowFloor as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(BelowFloor.exit_status)
