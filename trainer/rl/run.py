"""What one RL run holds: ``Run``, built by ``trainer.rl.loop.setup`` and shared by the phases of every step, and
``TrainResult``, what ``trainer.rl.loop.train`` returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from parity.guards import MaeRatioLimit
from rollout.base import RolloutEngine
from trainer.config import RunConfig
from trainer.distributed.data_parallel import DataParallel
from trainer.distributed.deepspeed import optimizer_step
from trainer.environments.episode_environment import EpisodeEnvironment
from trainer.io.run_logger import RunLogger
from trainer.lifecycle.stops import RecordWrites
from trainer.lifecycle.tool_use import ToolUseWatch
from trainer.lifecycle.truncation import TruncationWatch
from trainer.measurement.evaluation import BestCheckpoint, Evaluator
from trainer.measurement.merge_cost import MergeCost
from trainer.measurement.probe import Probe
from trainer.measurement.scoring import Scores
from trainer.measurement.timeline import Timeline
from trainer.models.exact import ExactLogprobs
from trainer.rl.critic import NegativeKLWatch
from trainer.rl.learner import Learner
from trainer.rl.value_head import ValueHead
from trainer.sampling.async_prefetch import Prefetch
from trainer.sampling.episode_sampler import sampler_for
from trainer.sampling.in_flight import InFlight
from trainer.sampling.policy_sync import PolicySync
from trainer.sampling.sampler import Sampler
from trainer.teacher.teacher import Teacher
from trainer.vision.prompts import VisionPrompts


@dataclass
class TrainResult:
    run_dir: Path
    history: list[dict] = field(default_factory=list)
    final_checkpoint: Optional[Path] = None
    wandb: str = ""


@dataclass
class Run:
    """What ``setup`` builds and the phases of a step share."""

    cfg: RunConfig
    accelerator: object
    stage: int  # DeepSpeed ZeRO stage, 0 = none
    dp: DataParallel
    model_dir: str
    tokenizer: object
    model: object  # the PEFT policy, or the DeepSpeed engine around it
    policy: object  # the PEFT model itself (weight sync, adapter checkpoint)
    value_head: Optional[ValueHead]
    optimizer: object
    scheduler: object
    params: list
    backward: object
    gather: object  # ZeRO-3: gathers one module's parameters for the weight export
    dataset: object
    batcher: object
    reward_fns: dict
    kl_controller: object = None
    kl_watch: Optional[NegativeKLWatch] = None
    modules: dict = field(default_factory=dict)  # extra modules in the checkpoint (PPO's value head)
    engine: Optional[RolloutEngine] = None
    own_engine: bool = True
    logger: Optional[RunLogger] = None
    probe: Optional[Probe] = None
    ratio_limit: Optional[MaeRatioLimit] = None  # parity.max_mae_ratio: the probe's level (checkpointed)
    exact: Optional[ExactLogprobs] = None  # when the precision recipe's log-probs are the engine's own
    start_step: int = 0
    tokens_seen: float = 0.0  # completion tokens trained on so far (checkpointed)
    truncation: TruncationWatch = field(default_factory=TruncationWatch)
    tool_use: ToolUseWatch = field(default_factory=ToolUseWatch)
    # rollout.max_staleness k (trainer/sampling/async_prefetch.py): the next k steps' batches, and the behaviour
    # adapter of the batch this step trains on (None: the current weights generated it) with its lag in versions
    prefetch: Prefetch = field(default_factory=Prefetch)
    behaviour: Optional[dict] = None
    behaviours: dict = field(default_factory=dict)  # in flight: the snapshot of every version its tokens may have
    lag: object = 0  # an int; with in-flight updates, [S, C] per token (trainer/measurement/staleness.py)
    vision: Optional[VisionPrompts] = None  # a vision-language run's prompts (data.image_column)
    in_flight: Optional[InFlight] = None  # rollout.in_flight (trainer/sampling/in_flight.py), None when off
    proximal: Optional[Scores] = None  # an off-policy batch scored by the weights before this step's update
    records: RecordWrites = field(default_factory=RecordWrites)  # a failed write of a record, till the step's end
    environment: Optional[EpisodeEnvironment] = None  # env: multi-turn episodes (trainer/sampling/episode_sampler.py)
    teacher: Optional[Teacher] = None  # on-policy distillation's teacher (trainer/teacher/), None without one
    evaluator: Optional[Evaluator] = None  # eval: held-out evaluation (trainer/measurement/evaluation.py)
    best: Optional[BestCheckpoint] = None  # checkpoint.best_metric (checkpointed)
    sync: Optional[PolicySync] = None  # the engine's sync: the adapter, or the merged weights (rollout.lora_sync)
    merge_cost: Optional[MergeCost] = None  # sync/merge_* of every sync
    routing: str = "off"  # parity.routing_replay resolved: replay | measure | off (trainer/models/routing_mode.py)
    timeline: Timeline = field(default_factory=Timeline)  # when the engine generated, when the trainer trained

    @property
    def device(self):
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def update(self) -> float:
        """Clip, optimizer step, zero: the pre-clip gradient norm."""
        return optimizer_step(self.accelerator, self.model, self.optimizer, self.params, self.cfg.train.max_grad_norm)

    @property
    def learner(self) -> Learner:
        """The run as the update passes see it (trainer/rl/update.py)."""
        return Learner(cfg=self.cfg, model=self.model, backward=self.backward, step=self.update,
                       value_head=self.value_head, dp=self.dp, exact=self.exact)

    @property
    def sampler(self) -> Sampler:
        """The run as a sampling round sees it: completions (trainer/sampling/sampler.py), or episodes with ``env``
        (trainer/sampling/episode_sampler.py); both hand the step a ``Drawn``."""
        return sampler_for(self.environment, cfg=self.cfg, engine=self.engine, batcher=self.batcher,
                           tokenizer=self.tokenizer, reward_fns=self.reward_fns, dp=self.dp, vision=self.vision)
