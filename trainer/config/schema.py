"""The recipe's schema: one typed dataclass per section; defaults live here and nowhere else."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from parity.corrections import CorrectionPlan
from trainer.algorithms import ALGORITHMS
from trainer.off_policy import OFF_POLICY


class RecipeError(ValueError):
    """A recipe that cannot run. The message names file, key, value and expectation.

    ``problems``: one line per problem (a recipe's loader reports every problem it finds at once,
    each line in the one-line format; the message is the lines joined).
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.problems = [message]

    @classmethod
    def several(cls, errors: list["RecipeError"]) -> "RecipeError":
        """One error holding every line of ``errors`` (each possibly several already), in order."""
        lines = [line for e in errors for line in getattr(e, "problems", [str(e)])]
        out = errors[0] if len(lines) == 1 else cls("\n".join(lines))
        out.problems = lines
        return out

    def lines(self, prefix: str = "") -> str:
        """Each problem on its own line after ``prefix`` (what the CLI prints)."""
        return "\n".join(prefix + " ".join(line.split()) for line in self.problems)


# --------------------------------------------------------------------------- sections


# The largest rollout.max_staleness: prime-rl's default bound (max_off_policy_steps 8) and the top of AReaL's
# sweep (max_head_offpolicyness 2-8). Each pending batch holds its rollouts and a snapshot of the trainable
# tensors in memory and in every checkpoint.
MAX_STALENESS = 8

@dataclass
class LoraConfig:
    enabled: bool = True  # False: train all parameters (used by the SFT warm start)
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # "all-linear": every nn.Linear inside the decoder blocks, found in the model (MoE routers
    # excluded; trainer.models.architecture.decoder_linear_leaves), printed at start.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class ModelConfig:
    # Local HF directory, a hub id, or "builtin:tiny" (the project's own tiny Llama,
    # warm-started with recipes/sft_tiny.yaml; built and cached on first use).
    path: str = "builtin:tiny"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # the precision recipe says which it runs in
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Transformers' attention kernel (trainer/models/attention.py, checked at load): null = eager where
    # the architecture needs it (Gemma2's attention softcap), else Transformers' default (SDPA).
    attn_implementation: Optional[Literal["sdpa", "eager", "flash_attention_2"]] = None


@dataclass
class DataConfig:
    # "builtin:arithmetic", a local .json/.jsonl/.parquet file or save_to_disk dir, or a hub id.
    source: str = "builtin:arithmetic"
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: Optional[str] = "answer"
    num_examples: Optional[int] = None
    use_chat_template: bool = True
    max_prompt_tokens: int = 64
    builtin_kwargs: dict[str, Any] = field(default_factory=dict)
    # The chat template's system turn (trainer.data.datasets.chat_messages): null = the template's
    # own default (SmolLM2 inserts ~20 tokens of it), "" = no system text, else this message.
    system_prompt: Optional[str] = None
    # Prompts longer than max_prompt_tokens (chat template included), found when the dataset is
    # loaded: error = refuse to start, naming the rows; drop = train without them (verl's
    # data.filter_overlong_prompts), the count logged.
    overlong_prompts: Literal["error", "drop"] = "error"
    # A vision-language model's images: the column holding each row's image(s) (a PIL image, a file path, encoded
    # bytes, a datasets.Image value, or a list of those), rendered with one placeholder each (docs/vision-language.md);
    # null = text prompts
    image_column: Optional[str] = None
    # Images a prompt may hold: what the engine reserves room for (vLLM's limit_mm_per_prompt, whose own default,
    # 999, sizes its start-up profiling for 999 images); a row with more is refused by name.
    max_images_per_prompt: int = 1
    # The image processor's settings for this run (e.g. {size: {longest_edge: 364}, do_image_splitting: false}; for
    # Qwen-VL min_pixels / max_pixels), given to both sides in one place: the trainer's processor call and vLLM's
    # (mm_processor_kwargs). Each name must be a setting of the model's image processor (checked before the model
    # loads); the input identity check then proves both sides used them. {} = the model's processor_config.json.
    image_processor: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardModelEntry:
    # A reward model written by `parityrl train-rm` (a local HF sequence-classification
    # directory, num_labels = 1), scoring prompt + completion (trainer/rewards/reward_model.py).
    path: str = ""
    batch_size: int = 32  # sequences per scoring forward
    baseline: float = 0.0  # subtracted from every score
    max_tokens: Optional[int] = None  # prompt + completion + EOS; null = the model's context; longer is an error


@dataclass
class RewardConfig:
    # name -> "module:function"; each f(prompts, completions, **columns) -> list[float]
    functions: dict[str, str] = field(default_factory=lambda: {"exact_answer": "trainer.data.tasks.arithmetic:exact_answer_reward"})
    # name -> reward model; shares the name space (and reward/<name> metrics) with functions
    models: dict[str, RewardModelEntry] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)  # missing names weigh 1.0
    # Seconds one call of a reward.functions entry may take (it scores the rank's whole batch), then the run
    # stops (exit 5); null = no limit, called in the main thread. 300: the server engine's per-request limit
    # (rollout.server_timeout_s); rule functions take milliseconds, batched judge / sandbox calls seconds.
    timeout_s: Optional[float] = 300.0


@dataclass
class AlgorithmConfig:
    """The recipe's ``algorithm:`` section: the keys every algorithm shares, plus ``options``.

    The section is written flat in a recipe (``algorithm: {name: gspo, group_size: 8, clip_eps_low:
    3e-4}``); the loader (``trainer.config.load``) puts the chosen algorithm's own keys into
    ``options``, an instance of its record's options type (``trainer.algorithms``), whose defaults
    are its paper's. A key of another algorithm is refused naming the algorithms that have it.
    """

    name: str = "grpo"
    group_size: int = 8  # completions per prompt (the record says the minimum)
    # Optimizer steps per rollout batch = epochs x mini_batches. With more than one, the
    # batch is scored once first (pi_old: ratios and parity), then each mini-batch (a seeded
    # shuffle per epoch) is one optimizer step.
    epochs: int = 1
    mini_batches: int = 1
    # DAPO's dynamic sampling (arXiv 2503.14476, Sec. 3.2; trainer/sampling/dynamic_sampling.py): drop
    # groups whose rewards are all equal (no GRPO signal) and draw further prompt batches until
    # rollout.prompts_per_step groups with signal are kept, at most max_sampling_rounds batches
    # per step (verl's DAPO example uses 10; verl's default, 0 = unlimited, can loop forever on
    # a task the policy always or never solves). Short after the last round: train on fewer groups.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 10
    # On-policy distillation as a term beside the task reward (trainer/algorithms/distill.py): the advantages
    # get distill_coef x -(log pi_student - log pi_teacher) per sampled token (needs teacher.path). 0 = off.
    # The `opd` algorithm is that signal alone (docs/distillation.md).
    distill_coef: float = 0.0
    # How an update treats a batch an older policy generated (rollout.max_staleness >= 1;
    # trainer/off_policy/): behaviour_clip, PPO's ratio and clip against the behaviour policy;
    # decoupled, AReaL's (arXiv 2505.24298): the clip against the policy before this step's update, times the
    # weight pi_prox / pi_behaviour, tokens whose weight exceeds behaviour_weight_cap left out (AReaL's
    # behav_imp_weight_cap; 5 in its example recipes); m2po (arXiv 2510.01161): the surrogate against
    # pi_behaviour on the tokens kept when the batch's mean (log pi_prox / pi_behaviour)^2 is brought below
    # m2_threshold by masking its largest terms (the paper's tau_M2, 0.04). Each is the on-policy update at k = 0.
    off_policy: str = "behaviour_clip"
    behaviour_weight_cap: float = 5.0
    m2_threshold: float = 0.04
    options: Any = None  # the record's options; None = its defaults

    def __post_init__(self) -> None:
        if self.options is None and self.name in ALGORITHMS:
            self.options = ALGORITHMS.get(self.name).options()

    @property
    def record(self):
        """The registered ``trainer.algorithms.Algorithm`` of ``name``."""
        return ALGORITHMS.get(self.name)

    @property
    def off_policy_record(self):
        """The registered ``trainer.off_policy.OffPolicyObjective`` of ``off_policy``."""
        return OFF_POLICY[self.off_policy]


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = "vllm"
    # colocate: the engine lives in the trainer's process. server: a separate vLLM server
    # (`parityrl serve <recipe>`) at server_url; weights are pushed after each step.
    mode: Literal["colocate", "server"] = "colocate"
    server_url: str = "http://127.0.0.1:8000"
    server_timeout_s: float = 300.0  # startup health wait and per-request limit
    server_connect_timeout_s: float = 30.0  # startup: give up when nothing has accepted a connection for this long
    prompts_per_step: int = 16
    temperature: float = 1.0
    # Truncated sampling (1.0 / 0 / 0.0: off). The engine reports the set of tokens it kept at every sampled
    # position and the trainer normalises its log-probs over that set (docs/parity-metrics.md "Truncated sampling").
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 24
    # The colocated engine's KV cache. null: 256 MiB on CPU (vLLM would otherwise reserve 92% of RAM); on CUDA vLLM
    # sizes it from the engine's share of the GPU, gpu_memory_utilization less the engine's weights, activations
    # and graphs as its start-up profile measures them (vllm/v1/worker/gpu_worker.py: determine_available_memory),
    # where a fixed default would fit ~4.7k tokens of a 7B model and serialise its rollouts. A size: exactly that
    # (rollout.vllm_engine.memory_options).
    kv_cache_memory_bytes: Optional[int] = None
    # CUDA only: the share of the GPU vLLM requires free when the colocated engine starts (its start-up check);
    # the one default of it (VLLMEngine has none of its own)
    gpu_memory_utilization: float = 0.3
    # null: eager on CPU (compiling costs more than it saves), CUDA graphs on CUDA (decoding a small model is
    # launch-bound; a sync keeps every weight's address, so the graphs stay valid: rollout.vllm_engine)
    enforce_eager: Optional[bool] = None
    # CUDA, colocated vLLM: the engine sleeps (vLLM sleep mode, level 1: weights to host memory, KV cache freed)
    # from the end of the rollout to the weight sync, so the update has the GPU to itself
    sleep_mode: bool = True
    max_num_seqs: int = 256
    # The engine (colocated, or a server as one weight version) takes the merged weights in
    # chunks of whole decoder layers of at most this size (trainer.sampling.engines.sync_weights): a
    # bound on the extra memory of a sync (the merged copy) instead of the whole model's size;
    # each extra chunk costs one more reload call / transfer round (~8 ms measured on CPU).
    # 1 GiB: ~2 layers of a 7B model, all of a small one.
    sync_chunk_bytes: int = 1024**3
    # Push the updated weights into the engine after every optimizer step. Turning it
    # off makes rollouts stale (off-policy); it exists so tests can show the parity
    # metrics catch exactly that.
    sync_weights: bool = True
    # How the engine gets the LoRA policy (docs/precision.md "LoRA in the engine"). adapter: the adapter itself,
    # served beside the engine's base weights (vLLM's LoRA; the HF engine's PEFT model), a new version every
    # sync, so the engine runs the trainer's update to the dtype's relative precision. merged: W + s·B·A rounded
    # to model.dtype (what the FP8 recipes and exact mode need; in BF16 an update below half a BF16 step of W
    # is lost). auto: adapter wherever the engine, the precision recipe and the LoRA targets allow it, else
    # merged, the reason printed once at start (trainer/precision/lora_sync.py).
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    # k >= 1: off-policy (trainer/sampling/async_prefetch.py): the batch of step s is generated k steps ahead,
    # by the weights before step s-k's update, while steps s-k .. s-1 train; in server mode the server
    # generates in parallel with the trainer. 0: generate, then train (on-policy). staleness/* measures the
    # lag. At most MAX_STALENESS.
    max_staleness: int = 0
    # Weight updates while a generation runs (server mode, k >= 1, merged sync; trainer/sampling/in_flight.py): off
    # waits for the launched generations before each sync (every token of a batch has its batch's version). keep:
    # the server pauses its requests, takes the new weights and continues them on the KV the old weights computed
    # (PipelineRL); recompute: the paused requests are re-prefilled under the new weights before they continue
    # (NeMo-RL's KV recompute). Every token carries the version that sampled it (Rollouts.versions).
    in_flight: Literal["off", "keep", "recompute"] = "off"


@dataclass
class EnvConfig:
    """The recipe's ``env:`` section: multi-turn episodes (trainer/sampling/episode_sampler.py). Neither ``class`` nor
    ``tools`` (the default): single-turn completions, as before.

    The key ``class`` is a Python keyword, so its field is ``class_`` (``recipe_key`` maps the two).
    """

    # An environment class, one instance per episode: reset(row) -> messages | None, step(message) ->
    # (messages, reward | None, done) (trainer/environments/contract.py). 'module:Name', 'path/file.py:Name' or
    # 'builtin:arithmetic_calculator'.
    class_: Optional[str] = None
    # Tools as plain functions: a mapping name -> function (or a list of functions) named by 'module:NAME',
    # 'path/file.py:NAME' or 'builtin:arithmetic_calculator'; offered through the chat template, the model's calls
    # parsed and run (trainer/environments/tools.py). Exactly one of class / tools.
    tools: Optional[str] = field(default=None, metadata={"expected": (
        "a string 'module:NAME' (or 'path/file.py:NAME', or 'builtin:arithmetic_calculator') naming a mapping "
        "name -> function or a list of functions in that module, or null; the mapping itself goes in the module, "
        "not in the recipe")})
    max_turns: int = 4  # assistant turns per episode
    # Token budget of an episode: prompt + every turn and reply (the engine's context is made this long).
    # null: data.max_prompt_tokens + max_turns x (rollout.max_new_tokens + max_observation_tokens).
    max_tokens: Optional[int] = None
    max_observation_tokens: int = 64  # one reply's ids; longer ends the episode (finish reason length)
    # Seconds one reset / step call (a tool environment: one tool call) may take; null = no limit.
    timeout_s: Optional[float] = 60.0
    # Extra chat-template variables at every rendering, e.g. {enable_thinking: false} for Qwen3.
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.class_ is not None or self.tools is not None


@dataclass
class EvalConfig:
    """The recipe's ``eval:`` section: held-out evaluation during RL (trainer/measurement/evaluation.py, docs/evaluation.md)."""

    # Every N steps, and before step 1 and after the last; 0 = off.
    every: int = 0
    # The held-out prompts: a source read like data.source (null: data.source itself) and its split. The built-in
    # tasks' "test" split shares no arithmetic fact with "train".
    source: Optional[str] = None
    split: str = "test"
    num_prompts: int = 64  # the source's first N rows (the same every evaluation)
    # k completions per prompt at `temperature` (top_p / top_k as rollout's): eval/mean@k and eval/pass@<j>;
    # 0 = none (greedy only)
    samples: int = 4
    temperature: float = 1.0
    pass_k: list[int] = field(default_factory=list)  # the j of eval/pass@j; empty: 1 and `samples`
    greedy: bool = True  # one greedy completion per prompt too: eval/greedy
    # A completion counts as solved when this reward function (null: the first of reward.functions) gives at
    # least success_threshold.
    success_reward: Optional[str] = None
    success_threshold: float = 1.0
    # A column of the held-out rows naming each row's data source: every eval/ accuracy per source too
    source_column: str = "source"


def recipe_key(field_name: str) -> str:
    """The recipe key of a schema field: the name, less the trailing underscore that a Python keyword
    needs as a field name (PEP 8), e.g. ``class_`` -> ``class``."""
    return field_name[:-1] if field_name.endswith("_") else field_name


# The recipes' lr_schedule names; trainer/models/optim.py maps them to transformers.get_scheduler's.
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class StageTrainConfig:
    """The ``train:`` keys of every training stage (`parityrl train`, `sft`, `train-rm`).

    The four keys without a default here get theirs from each stage's section, which redeclares them
    (the RL loop also narrows their types: a fixed micro-batch size, a Literal schedule).
    """

    steps: int
    learning_rate: float
    # rows per forward/backward; the rest of the step's batch is gradient accumulation
    micro_batch_size: Optional[int]
    # transformers.get_scheduler (trainer/models/optim.py): constant(_with_warmup), linear, cosine
    lr_schedule: str
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # instead of warmup_steps: ceil(ratio x steps) (TrainingArguments' rule)
    seed: int = 0
    # CPU runs: the OpenMP threads torch and the colocated vLLM engine share (trainer/distributed/cpu_threads.py);
    # null: one per core. 1 keeps a small model fast on a machine shared with other work.
    cpu_threads: Optional[int] = None
    # Recompute each decoder layer's activations in the backward (trainer/models/checkpointing.py):
    # far less activation memory for about one more forward pass.
    gradient_checkpointing: bool = False


@dataclass
class TrainConfig(StageTrainConfig):
    steps: int = 40
    learning_rate: float = 2e-3
    micro_batch_size: int = 32  # samples per forward/backward; the rest is gradient accumulation
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # Each micro-batch's sequences packed into rows as long as its longest (trainer/models/packing.py):
    # no padding reaches the backbone. sdpa / eager attention only, checked on the model at load.
    pack_sequences: bool = False
    # CPU runs: the pool during the update (scoring, loss, backward, optimizer step) when it should differ from the
    # rollout's (train.cpu_threads); null: the same. A small model decodes as fast on one thread as on two but
    # updates faster on two (trainer/distributed/cpu_threads.py).
    update_cpu_threads: Optional[int] = None


@dataclass
class CorrectionSection:
    """The recipe's ``parity.correction:`` section: how the loss corrects for the engine/trainer mismatch
    (parity/corrections, docs/corrections.md).

    Written with each chosen rule's options under the rule's name::

        parity:
          correction:
            rule: [token_tis, seq_mean_k3]   # none, one rule, or a list (at most one importance weight)
            token_tis: {cap: 3.0}            # options of a chosen rule (defaults: the rule's source)
            shadow: true

    The loader (``trainer.config.load``) parses ``<rule>:`` into ``options`` (rule -> its options object, every
    chosen rule present); a preset is expanded there into ``rule``, its options and ``bypass``.
    """

    # none, a rule name or a list of them: at most one importance weight (token_tis, token_mis, seq_tis, seq_mis)
    # and any rejections (token_k1..k3, seq_sum_k*, seq_mean_k*, seq_max_k2/k3, opsm), multiplied as verl does.
    rule: Union[str, list[str]] = "none"
    # verl's presets by name (parity/corrections/presets.py), instead of rule: expanded when the recipe is read.
    preset: Optional[str] = None
    # Divide the importance weights by their batch mean (verl's rollout_is_batch_normalize); pi_old is then scored
    # before the update (one gradient-free forward more per step with a single on-policy update).
    batch_normalize: bool = False
    # pi_old := the engine's log-probs (verl's bypass mode): PPO's ratio pi_theta / pi_rollout is the importance
    # weight, so only rejection rules may join it; one on-policy update per batch, without a critic.
    bypass: bool = False
    # The KL penalty's unbiased form (DeepSeek-V3.2 Sec. 3.1): its per-token k3 weighted by pi_theta / pi_rollout.
    unbiased_kl: bool = False
    # Every logging.breakdown_every steps, every rule's weights on the step's batch side by side (no extra forward):
    # parity_breakdown.jsonl's correction_shadow and the wandb table parity_tables/correction_shadow.
    shadow: bool = False
    options: Any = None  # rule -> its options object (parity.correction.<rule>: in a recipe); None = no rule

    @property
    def rules(self) -> tuple[str, ...]:
        if isinstance(self.rule, str):
            return () if self.rule == "none" else (self.rule,)
        return tuple(self.rule)

    @property
    def plan(self) -> CorrectionPlan:
        """The run's ``parity.corrections.CorrectionPlan`` (empty without a rule)."""
        return CorrectionPlan(self.rules, dict(self.options or {}), batch_normalize=self.batch_normalize)


@dataclass
class ParityConfig:
    chunk_size: Optional[int] = None  # rows of [chunk x vocab] logits at a time; None = from a memory budget
    correction: CorrectionSection = field(default_factory=CorrectionSection)
    # Limits on the step's mismatch (null = none); checked before the optimizer step.
    max_mae: Optional[float] = None
    max_kl_k3: Optional[float] = None
    on_violation: Literal["warn", "stop"] = "warn"  # stop: raise before applying the step's update
    # Full-distribution parity: the engine's top-k log-probs per position -> parity/topk_kl
    # (a lower bound on the full KL; parity.metrics.topk_kl). 0 = off: it costs the engine
    # a top-k per token and the trainer a gather.
    topk: int = 0
    # Fixed prompts (the dataset's first N) generated and scored after every weight sync
    # and before step 1 -> probe/* (trainer/measurement/probe.py); limits above apply to them too. 0 = off.
    probe_prompts: int = 4
    # The probe runs after the first probe_first syncs, then after every probe_every-th
    # (trainer/measurement/probe.py: one prefill in the engine + one forward in the trainer per probe).
    # Every 2nd: measured 3.4% of a demo step when it ran after every sync (bench/parity/bench_exact.py's
    # bf16 run, 30 steps), above the 3% budget; a sync that stays broken is caught by the next probe,
    # one that fails once shows in the next step's parity/* (docs/parity-metrics.md "The probe").
    probe_every: int = 2
    probe_first: int = 3
    # Relative limit (parity.guards.MaeRatioLimit): a probe's mae above this many times the probe's
    # level (the highest of its last 5 healthy values, never below the precision recipe's floor) is a
    # violation; the step's parity/mae drifts as the policy sharpens and is judged by max_mae only.
    # On by default: what is normal depends on model depth and dtype (docs/parity-metrics.md "What
    # is normal"), a jump on the same fixed sequences does not. null = off.
    max_mae_ratio: Optional[float] = 5.0
    # Mixture-of-experts models: auto | on | off | measure (trainer/models/routing_mode.py, docs/moe.md).
    # on: the trainer's routers use the experts the engine chose (rollout routing replay, R3: arXiv
    # 2510.11370); measure: only log how often they agree; auto: on for a supported MoE family, else off.
    # YAML 1.1 reads a bare on / off as true / false: both spellings are accepted.
    routing_replay: Union[bool, Literal["auto", "on", "off", "measure"]] = "auto"
    # With replay, every this many steps the step's batch is also scored without it -> parity/unreplayed/*
    # (what replay removes: one more gradient-free forward on those steps). 0 = never.
    unreplayed_every: int = 10


@dataclass
class TeacherConfig:
    """The recipe's ``teacher:`` section: the model that scores the student's sampled tokens in on-policy
    distillation (``algorithm.name: opd`` or ``algorithm.distill_coef``; docs/distillation.md)."""

    # A local HF directory, a hub id or a built-in (builtin:tiny-teacher); it must share the student's
    # tokenizer (checked before training). null = no teacher.
    path: Optional[str] = None
    # Who scores it: vllm (a second colocated vLLM engine: prompt log-probs, one prefill per sequence), hf
    # (a Transformers forward, the reference), server (a `parityrl serve` of the teacher at server_url, scored
    # through the same client and route as rollout.mode server: rollout/server_engine/) or vllm_url (any vLLM
    # OpenAI-compatible server at server_url, e.g. `vllm serve <teacher>`: /v1/completions with prompt_logprobs,
    # rollout/completions_scorer.py; it must have loaded teacher.path's model, whose tokenizer is the one checked).
    engine: Literal["vllm", "hf", "server", "vllm_url"] = "vllm"
    # server: http://HOST:PORT; vllm_url: the server's root, http(s)://HOST[:PORT][/PREFIX] (no /v1)
    server_url: Optional[str] = None
    # the teacher server's start-up wait and the limit of every request (rollout.server_timeout_s's default)
    server_timeout_s: float = 300.0
    # null = model.dtype (what the precision recipe runs the student in).
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    # teacher_parity/*: the teacher engine vs the teacher scored by the trainer's fused kernel on the step's
    # tokens; null = on the probe's schedule (parity.probe_first, parity.probe_every), N = every N steps, 0 = never.
    # It loads the teacher into the trainer's process too (its weights, no gradient).
    parity_every: Optional[int] = None


@dataclass
class PrecisionConfig:
    # Both phases' numerics: a recipe registered in trainer/precision/ (one record per name: its model
    # dtypes, engine options, trainer model transform and refusals; docs/precision.md). The name is checked
    # against the registry when the recipe loads (trainer.lifecycle.preflight.load_recipe): the registry sits above
    # this package. The default is trainer.precision.registry.DEFAULT_RECIPE (a test holds them equal).
    recipe: str = "bf16"


@dataclass
class CheckpointConfig:
    every: int = 10  # steps; 0 = only at the end
    keep_last: int = 2
    # A metric (e.g. eval/mean@4): the step where it was best is checkpointed and kept besides keep_last
    # (trainer/measurement/evaluation.py ``BestCheckpoint``); null = none. best_mode: max or min is best.
    best_metric: Optional[str] = None
    best_mode: Literal["max", "min"] = "max"


@dataclass
class WandbConfig:
    # auto: online if credentials are found, else offline. Never fails a run for lack of network.
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "parityrl"
    entity: Optional[str] = None


@dataclass
class StageLoggingConfig:
    """The ``logging:`` keys of every training stage: the run directory and its wandb run."""

    # metrics.jsonl, the wandb run (its id kept for --resume) and checkpoints live here
    run_dir: str = "runs/{name}"
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class LoggingConfig(StageLoggingConfig):
    print_every: int = 1
    breakdown_every: int = 10  # parity breakdown tables to wandb every N steps (the jsonl file gets every step)
    # A samples table (prompt, completion, rewards, length, finish reason, the sample's parity) to
    # samples.jsonl and wandb at the first step and every N steps; 0 = off (trainer/lifecycle/samples_table.py).
    samples_every: int = 10
    samples_per_step: int = 8


@dataclass
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name))
