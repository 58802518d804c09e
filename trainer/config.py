"""Recipe schema: typed dataclasses per section, defaults only here, one validation pass.

A recipe is a YAML file (see ``recipes/``) plus ``--set key=value`` overrides.
Loading checks, before anything heavy starts: unknown keys, wrong types,
impossible values and cross-field contradictions. Each problem is reported
with the file, the dotted key, the value and what was expected.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


# Algorithms the step loop can run today. Others (ppo, pmd_mean, gspo, ...) are registered
# as tested pure functions, but need recipe fields (tau, gamma, ...) or inputs (a critic)
# that the loop does not provide yet, so a recipe naming them is refused up front.
# Algorithms the step loop runs (algorithm.name).
LOOP_ALGORITHMS = ("grpo", "dr_grpo", "gspo", "rloo", "reinforce_pp_baseline", "pmd_mean", "pmd_part", "ppo")
# Algorithms with a learned critic (trainer/value_head.py): they score each batch before updating.
CRITIC_ALGORITHMS = ("ppo",)


class RecipeError(ValueError):
    """A recipe that cannot run. The message names file, key, value and expectation."""


# --------------------------------------------------------------------------- sections


@dataclass
class LoraConfig:
    enabled: bool = True  # False: train all parameters (used by the SFT warm start)
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class ModelConfig:
    # Local HF directory, a hub id, or "builtin:tiny" (the project's own tiny Llama,
    # warm-started with recipes/sft_tiny.yaml; built and cached on first use).
    path: str = "builtin:tiny"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # float16: with precision.recipe fp16 only
    lora: LoraConfig = field(default_factory=LoraConfig)


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


@dataclass
class RewardModelEntry:
    # A reward model written by `parityrl train-rm` (a local HF sequence-classification
    # directory, num_labels = 1), scoring prompt + completion (trainer/reward_model.py).
    path: str = ""
    batch_size: int = 32  # sequences per scoring forward
    baseline: float = 0.0  # subtracted from every score
    max_tokens: Optional[int] = None  # prompt + completion + EOS; null = the model's context; longer is an error


@dataclass
class RewardConfig:
    # name -> "module:function"; each f(prompts, completions, **columns) -> list[float]
    functions: dict[str, str] = field(default_factory=lambda: {"exact_answer": "trainer.tasks.arithmetic:exact_answer_reward"})
    # name -> reward model; shares the name space (and reward/<name> metrics) with functions
    models: dict[str, RewardModelEntry] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)  # missing names weigh 1.0


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    group_size: int = 8
    scale_rewards: bool = True  # divide by the group's std (False = Dr. GRPO, arXiv 2503.20783)
    eps: float = 1e-4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO's clip-higher uses 0.28 (arXiv 2503.14476)
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    kl_coef: float = 0.0  # k3 penalty to the reference (the base with the adapter disabled)
    tau: float = 0.01  # PMD's proximal (KL) weight; the authors use 0.01-0.1 (arXiv 2602.05933)
    # Optimizer steps per rollout batch = epochs x mini_batches. With more than one, the
    # batch is scored once first (pi_old: ratios and parity), then each mini-batch (a seeded
    # shuffle per epoch) is one optimizer step.
    epochs: int = 1
    mini_batches: int = 1
    # DAPO's dynamic sampling (arXiv 2503.14476, Sec. 3.2; trainer/dynamic_sampling.py): drop
    # groups whose rewards are all equal (no GRPO signal) and draw further prompt batches until
    # rollout.prompts_per_step groups with signal are kept, at most max_sampling_rounds batches
    # per step (verl's DAPO example uses 10; verl's default, 0 = unlimited, can loop forever on
    # a task the policy always or never solves). Short after the last round: train on fewer groups.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 10
    # PPO (trainer/algorithms/ppo.py; defaults follow TRL's PPOConfig, as in StackLLaMA):
    gamma: float = 1.0  # GAE discount over completion tokens
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True
    # Scale the KL-shaped token rewards to unit variance over the batch, keeping their mean
    # (TRL's whiten_rewards: masked_whiten(..., shift_mean=False)); off by default as in TRL.
    whiten_rewards: bool = False
    vf_coef: float = 0.1  # value-loss weight (the critic shares the policy's trunk)
    value_clip: Optional[float] = 0.2  # null = unclipped value loss
    ent_coef: float = 0.0  # entropy bonus
    reward_kl_coef: float = 0.05  # beta of the per-token -beta*KL(pi || ref) in the reward
    reward_kl_target: Optional[float] = None  # null = fixed beta; a number = adaptive controller (Ziegler: 6 nats)
    reward_kl_horizon: int = 10000  # adaptive controller horizon, in samples
    reward_kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # per-token KL estimator in the reward (TRL: k1)


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = "vllm"
    # colocate: the engine lives in the trainer's process. server: a separate vLLM server
    # (`parityrl serve <recipe>`) at server_url; weights are pushed after each step.
    mode: Literal["colocate", "server"] = "colocate"
    server_url: str = "http://127.0.0.1:8000"
    server_timeout_s: float = 300.0  # startup health wait and per-request limit
    prompts_per_step: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 24
    kv_cache_memory_bytes: int = 256 * 1024**2  # CPU backend only; it would otherwise reserve 92% of RAM
    gpu_memory_utilization: float = 0.3  # CUDA only: the share the colocated engine may take
    enforce_eager: bool = True
    max_num_seqs: int = 256
    # The engine (colocated, or a server as one weight version) takes the merged weights in
    # chunks of whole decoder layers of at most this size (trainer.engines.sync_weights): a
    # bound on the extra memory of a sync (the merged copy) instead of the whole model's size;
    # each extra chunk costs one more reload call / transfer round (~8 ms measured on CPU).
    # 1 GiB: ~2 layers of a 7B model, all of a small one.
    sync_chunk_bytes: int = 1024**3
    # Push the updated weights into the engine after every optimizer step. Turning it
    # off makes rollouts stale (off-policy); it exists so tests can show the parity
    # metrics catch exactly that.
    sync_weights: bool = True


@dataclass
class TrainConfig:
    steps: int = 40
    learning_rate: float = 2e-3
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    micro_batch_size: int = 32  # samples per forward/backward; the rest is gradient accumulation
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    seed: int = 0


@dataclass
class CorrectionSection:
    # Importance weights between trainer and rollout policy, multiplied into the
    # per-token loss (parity.correction): none | tis | mis | seq_mis.
    mode: Literal["none", "tis", "mis", "seq_mis"] = "none"
    tis_cap: float = 2.0  # tis: w = min(rho, tis_cap)
    low: float = 0.5  # mis / seq_mis: keep tokens (sequences) with rho in [low, high]
    high: float = 2.0


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
    # and before step 1 -> probe/* (trainer/probe.py); limits above apply to them too. 0 = off.
    probe_prompts: int = 4


@dataclass
class PrecisionConfig:
    # Both phases' numerics (README "Precision recipes"):
    #   bf16        both phases BF16 (model.dtype bfloat16)
    #   fp16        both phases FP16 (model.dtype float16)
    #   fp8_rollout BF16 trainer, FP8 engine (the common verl/slime/NeMo-RL setup; the baseline)
    #   fp8_unified both phases the same FP8 linear layers, one quantizer (parity.precision; Jet-RL)
    recipe: Literal["bf16", "fp16", "fp8_rollout", "fp8_unified"] = "bf16"


@dataclass
class CheckpointConfig:
    every: int = 10  # steps; 0 = only at the end
    keep_last: int = 2


@dataclass
class WandbConfig:
    # auto: online if credentials are found, else offline. Never fails a run for lack of network.
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "parityrl"
    entity: Optional[str] = None


@dataclass
class LoggingConfig:
    run_dir: str = "runs/{name}"
    wandb: WandbConfig = field(default_factory=WandbConfig)
    print_every: int = 1
    breakdown_every: int = 10  # parity breakdown tables to wandb every N steps (the jsonl file gets every step)


@dataclass
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name))


# --------------------------------------------------------------------------- building


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"a mapping of {_describe(k)} to {_describe(v)}"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int -> float, dict -> dataclass)."""

    def bad() -> RecipeError:
        return RecipeError(f"{where}: {key} = {value!r}: expected {_describe(tp)}")

    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return _build(tp, value, key, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key, where)
            except RecipeError:
                pass
        raise bad()
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad()
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad()
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        kt, vt = typing.get_args(tp)
        return {_convert(k, kt, key, where): _convert(v, vt, f"{key}.{k}", where) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML reads "1e-4" (no dot) as a string (YAML 1.1); accept what float() reads.
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    raise TypeError(f"config.py: unsupported annotation {tp!r} for {key}")


# Sampling options a user may expect but the trainer cannot reproduce in its log-probs:
# they change the distribution the engine samples from in ways that depend on the
# sequence so far (penalties), force or suppress tokens (min_tokens suppresses EOS,
# logit_bias, bad_words), or truncate it (min_p). The engine's log-probs would then
# not be log softmax(logits / T) and every parity metric would measure the sampler,
# not the numerics -- the negative-KL trouble of the StackLLaMA write-up
# (https://huggingface.co/blog/stackllama, "a negative KL"). Refused with the reason.
UNREPRODUCIBLE_SAMPLING = {
    "rollout.repetition_penalty": "a repetition penalty rescales logits by the sequence so far",
    "rollout.presence_penalty": "a presence penalty shifts logits by the sequence so far",
    "rollout.frequency_penalty": "a frequency penalty shifts logits by the sequence so far",
    "rollout.min_tokens": "min_tokens suppresses EOS for the first tokens (EOS gets probability 0)",
    "rollout.min_p": "min_p truncates the distribution by a probability threshold",
    "rollout.logit_bias": "a logit bias adds constants the trainer does not add",
    "rollout.bad_words": "bad_words forbids tokens (probability 0 in the engine only)",
    "rollout.allowed_token_ids": "allowed_token_ids masks the vocabulary in the engine only",
}


def _build(cls: type, data: dict, prefix: str, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names and key in UNREPRODUCIBLE_SAMPLING:
            raise RecipeError(f"{where}: {key} = {v!r}: not supported: {UNREPRODUCIBLE_SAMPLING[key]}, so the trainer "
                              "could not score the sampled tokens under the distribution they were drawn from "
                              "(parity metrics and importance ratios would measure the sampler). Remove the key.")
        if k not in names:
            raise RecipeError(f"{where}: unknown key {key!r}; valid keys here: {', '.join(names)}")
        kwargs[k] = _convert(v, hints[k], key, where)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"{where}: --set {dotted}: {p!r} holds a value, not a section")
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` -> (key, YAML-parsed value): ``--set train.steps=5`` gives an int."""
    if "=" not in text:
        raise RecipeError(f"--set {text!r}: expected key=value, e.g. --set train.steps=5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError(f"--set {text!r}: the key before '=' is empty")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def load_recipe_dict(path: str | os.PathLike, overrides: list[str] = ()) -> tuple[dict, str]:
    p = Path(path)
    where = str(p)
    if not p.is_file():
        raise RecipeError(f"{where}: recipe file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping of sections at the top level, got {type(data).__name__}")
    for o in overrides:
        k, v = parse_override(o)
        _set_dotted(data, k, v, where)
    return data, where


def build_config(cls: type, data: dict, where: str = "<recipe>"):
    return _build(cls, data, "", where)


def load_recipe(path: str | os.PathLike, overrides: list[str] = (), *, check_paths: bool = True) -> RunConfig:
    """Read, override, type-check and validate a training recipe."""
    data, where = load_recipe_dict(path, overrides)
    cfg = build_config(RunConfig, data, where)
    validate(cfg, where, check_paths=check_paths)
    return cfg


# --------------------------------------------------------------------------- validation


def _looks_local(path: str) -> bool:
    # Hub ids ("org/name") also contain a slash, so only an explicit path prefix or an
    # existing path counts as local; anything else is left to the hub loader.
    return path.startswith((".", "/", "~")) or Path(path).expanduser().exists()


def model_max_positions(model_path: str) -> Optional[int]:
    """The model's context length from its config.json, without loading weights (None if unknown)."""
    if model_path.startswith("builtin:"):
        from trainer.default_model import builtin_max_positions

        return builtin_max_positions(model_path)
    cfg_file = Path(model_path).expanduser() / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        conf = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return conf.get("max_position_embeddings") or conf.get("n_positions") or conf.get("max_seq_len")


def validate(cfg: RunConfig, where: str = "<recipe>", *, check_paths: bool = True) -> None:
    """Value ranges and cross-field rules. Raises RecipeError on the first problem."""

    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise RecipeError(f"{where}: {key} = {value!r}: expected {expected}")

    a, r, t = cfg.algorithm, cfg.rollout, cfg.train
    from trainer.algorithms import ADVANTAGES, POLICY_LOSSES

    registered = set(ADVANTAGES.names()) & set(POLICY_LOSSES.names())
    need(a.name in registered and a.name in LOOP_ALGORITHMS, "algorithm.name", a.name,
         "one of " + ", ".join(LOOP_ALGORITHMS))
    if a.name in CRITIC_ALGORITHMS:
        need(a.group_size >= 1, "algorithm.group_size", a.group_size, "an integer >= 1")
        need(0 <= a.gamma <= 1, "algorithm.gamma", a.gamma, "a number in [0, 1]")
        need(0 <= a.lam <= 1, "algorithm.lam", a.lam, "a number in [0, 1]")
        need(a.vf_coef >= 0, "algorithm.vf_coef", a.vf_coef, "a number >= 0")
        need(a.value_clip is None or a.value_clip > 0, "algorithm.value_clip", a.value_clip, "null or a number > 0")
        need(a.ent_coef >= 0, "algorithm.ent_coef", a.ent_coef, "a number >= 0")
        need(a.reward_kl_coef >= 0, "algorithm.reward_kl_coef", a.reward_kl_coef, "a number >= 0")
        need(a.reward_kl_target is None or a.reward_kl_target > 0, "algorithm.reward_kl_target", a.reward_kl_target,
             "null (fixed beta) or a number > 0 (nats per sequence)")
        need(a.reward_kl_horizon >= 1, "algorithm.reward_kl_horizon", a.reward_kl_horizon, "an integer >= 1")
    else:
        need(a.group_size >= 2, "algorithm.group_size", a.group_size,
             "an integer >= 2 (GRPO's advantage compares completions of the same prompt)")
    need(a.eps > 0, "algorithm.eps", a.eps, "a number > 0")
    need(0 <= a.clip_eps_low < 1, "algorithm.clip_eps_low", a.clip_eps_low, "a number in [0, 1)")
    need(a.clip_eps_high >= 0, "algorithm.clip_eps_high", a.clip_eps_high, "a number >= 0")
    need(a.kl_coef >= 0, "algorithm.kl_coef", a.kl_coef, "a number >= 0")
    need(a.tau > 0, "algorithm.tau", a.tau, "a number > 0 (PMD's KL weight; the authors use 0.01-0.1)")
    if a.name.startswith("pmd"):
        need(a.kl_coef == 0, "algorithm.kl_coef", a.kl_coef,
             f"0 for {a.name}: PMD has no KL-to-reference term, tau is its proximal weight")
    if a.dynamic_sampling:
        need(a.name not in CRITIC_ALGORITHMS, "algorithm.dynamic_sampling", a.dynamic_sampling,
             f"false for {a.name}: it keeps groups whose rewards differ, a group-relative criterion")
    need(isinstance(a.max_sampling_rounds, int) and a.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds",
         a.max_sampling_rounds, "an integer >= 1 (prompt batches drawn per step with dynamic sampling)")
    need(a.epochs >= 1, "algorithm.epochs", a.epochs, "an integer >= 1")
    need(a.mini_batches >= 1, "algorithm.mini_batches", a.mini_batches, "an integer >= 1")
    samples = r.prompts_per_step * a.group_size
    need(samples % a.mini_batches == 0, "algorithm.mini_batches", a.mini_batches,
         f"a divisor of the {samples} samples per step (rollout.prompts_per_step x algorithm.group_size), "
         "so every optimizer step sees the same number of samples")

    need(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, "an integer >= 1")
    need(r.temperature > 0, "rollout.temperature", r.temperature, "a number > 0 (greedy decoding has no log-probs to learn from)")
    need(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "a number in (0, 1]")
    need(r.top_k >= 0, "rollout.top_k", r.top_k, "an integer >= 0 (0 = off)")
    # The trainer scores tokens under softmax(logits / T) over the full vocabulary. The
    # engine reports processed log-probs (after truncation, renormalised over the kept
    # tokens), so with top-p / top-k the two sides would describe different
    # distributions and the difference would be mis-read as numerical mismatch;
    # reproducing the truncation needs whole sorted rows, which the chunked kernel avoids.
    need(r.top_p == 1.0, "rollout.top_p", r.top_p,
         "1.0: the trainer scores tokens under the untruncated softmax(logits / T) and cannot reproduce top-p "
         "truncation (the engine's processed log-probs are renormalised over the kept tokens)")
    need(r.top_k == 0, "rollout.top_k", r.top_k,
         "0: the trainer scores tokens under the untruncated softmax(logits / T) and cannot reproduce top-k "
         "truncation (the engine's processed log-probs are renormalised over the kept tokens)")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "an integer >= 1")
    need(r.kv_cache_memory_bytes >= 16 * 1024**2, "rollout.kv_cache_memory_bytes", r.kv_cache_memory_bytes, "at least 16 MiB")
    need(0 < r.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization", r.gpu_memory_utilization, "a number in (0, 1)")
    need(r.max_num_seqs >= 1, "rollout.max_num_seqs", r.max_num_seqs, "an integer >= 1")
    need(r.sync_chunk_bytes >= 1, "rollout.sync_chunk_bytes", r.sync_chunk_bytes, "an integer >= 1 (bytes)")
    if r.mode == "server":  # the same parser the engine and `parityrl serve` use
        from rollout.server_engine import parse_server_url

        try:
            parse_server_url(r.server_url)
        except ValueError as e:
            raise RecipeError(f"{where}: {e}") from None
    need(r.server_timeout_s > 0, "rollout.server_timeout_s", r.server_timeout_s, "a number of seconds > 0")

    need(t.steps >= 1, "train.steps", t.steps, "an integer >= 1")
    need(t.learning_rate > 0, "train.learning_rate", t.learning_rate, "a number > 0")
    need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "a number >= 0")
    need(len(t.adam_betas) == 2 and all(0 <= b < 1 for b in t.adam_betas), "train.adam_betas", t.adam_betas,
         "two numbers in [0, 1)")
    need(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "an integer >= 1")
    need(t.max_grad_norm > 0, "train.max_grad_norm", t.max_grad_norm, "a number > 0")
    need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "an integer >= 0")

    lora = cfg.model.lora
    need(lora.r >= 1, "model.lora.r", lora.r, "an integer >= 1")
    need(lora.alpha > 0, "model.lora.alpha", lora.alpha, "a number > 0")
    need(0 <= lora.dropout < 1, "model.lora.dropout", lora.dropout, "a number in [0, 1)")
    # The training log-probs are the parity metrics' train side and the importance
    # ratios' numerator: dropout would make them random, and the mismatch measured
    # would be dropout noise, not numerics.
    need(lora.dropout == 0, "model.lora.dropout", lora.dropout,
         "0 for RL training: dropout makes the trainer's log-probs random, so the parity metrics and the "
         "importance ratios would measure dropout noise (use it in `parityrl sft`)")
    need(len(lora.target_modules) > 0, "model.lora.target_modules", lora.target_modules, "a non-empty list of module names")
    # The train-side log-probs read the lm_head weight directly (fused kernel); a LoRA on
    # it would be silently ignored there, so it is refused.
    need("lm_head" not in lora.target_modules, "model.lora.target_modules", lora.target_modules, "a list without 'lm_head'")
    need(cfg.model.lora.enabled, "model.lora.enabled", False,
         "true for RL training (the reference policy is the base with the adapter disabled); full fine-tuning is for `parityrl sft`")

    need(cfg.data.max_prompt_tokens >= 1, "data.max_prompt_tokens", cfg.data.max_prompt_tokens, "an integer >= 1")
    need(cfg.data.num_examples is None or cfg.data.num_examples >= 1, "data.num_examples", cfg.data.num_examples,
         "null or an integer >= 1")
    rw = cfg.reward
    need(len(rw.functions) + len(rw.models) > 0, "reward.functions", rw.functions,
         "at least one name: 'module:function' (or a reward model under reward.models)")
    for name, spec in rw.functions.items():
        need(":" in spec and all(spec.split(":", 1)), f"reward.functions.{name}", spec, "'module:function'")
    for name, rm in rw.models.items():
        key = f"reward.models.{name}"
        need(name not in rw.functions, key, rm.path, f"a name not also used in reward.functions ({name!r} is both; "
             "each name is one reward/<name> metric)")
        need(bool(rm.path), f"{key}.path", rm.path, "the directory written by `parityrl train-rm`")
        need(rm.batch_size >= 1, f"{key}.batch_size", rm.batch_size, "an integer >= 1")
        need(math.isfinite(rm.baseline), f"{key}.baseline", rm.baseline, "a finite number")
        # The scorer re-encodes the decoded prompt + completion and appends EOS; a rollout
        # can be max_prompt_tokens + max_new_tokens long, so a smaller limit would fail mid-run.
        longest = cfg.data.max_prompt_tokens + r.max_new_tokens + 1
        need(rm.max_tokens is None or rm.max_tokens >= longest, f"{key}.max_tokens", rm.max_tokens,
             f"null or at least data.max_prompt_tokens + rollout.max_new_tokens + 1 (EOS) = {longest}")
        if check_paths:
            need((Path(rm.path).expanduser() / "config.json").is_file(), f"{key}.path", rm.path,
                 "a local reward-model directory with a config.json (written by `parityrl train-rm`)")
    sources = list(rw.functions) + list(rw.models)
    for name in rw.weights:
        need(name in sources, f"reward.weights.{name}", rw.weights[name],
             "a weight for a name listed in reward.functions or reward.models (" + ", ".join(sources) + ")")
    need(cfg.parity.chunk_size is None or cfg.parity.chunk_size >= 1, "parity.chunk_size", cfg.parity.chunk_size,
         "null or an integer >= 1")
    for key in ("max_mae", "max_kl_k3"):
        v = getattr(cfg.parity, key)
        need(v is None or v > 0, f"parity.{key}", v, "null or a number > 0")
    # The top-k costs a [tokens, k] transfer per step; beyond a few hundred the rest
    # bucket is negligible anyway and vLLM's sampler slows down (torch.topk on the vocab).
    need(0 <= cfg.parity.topk <= 256, "parity.topk", cfg.parity.topk, "an integer in [0, 256] (0 = off)")
    rec, dt = cfg.precision.recipe, cfg.model.dtype
    need(rec != "fp16" or dt == "float16", "model.dtype", dt,
         "float16 with precision.recipe fp16 (both phases run in FP16)")
    need(dt != "float16" or rec == "fp16", "model.dtype", dt,
         "bfloat16 or float32 unless precision.recipe is fp16 (set precision.recipe: fp16 to run in FP16)")
    need(not rec.startswith("fp8") or dt == "bfloat16", "model.dtype", dt,
         f"bfloat16 with precision.recipe {rec} (BF16 master weights; the FP8 layers dequantize to BF16)")
    need(not (rec.startswith("fp8") and r.engine == "hf"), "rollout.engine", r.engine,
         f"'vllm' with precision.recipe {rec} (the HF engine has no FP8 path)")
    need(cfg.parity.probe_prompts >= 0, "parity.probe_prompts", cfg.parity.probe_prompts, "an integer >= 0 (0 = off)")
    try:
        correction_config(cfg)
    except ValueError as e:
        raise RecipeError(f"{where}: parity.correction.{e}") from None
    need(cfg.checkpoint.every >= 0, "checkpoint.every", cfg.checkpoint.every, "an integer >= 0")
    need(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", cfg.checkpoint.keep_last, "an integer >= 1")
    need(cfg.logging.breakdown_every >= 1, "logging.breakdown_every", cfg.logging.breakdown_every, "an integer >= 1")
    need(cfg.logging.print_every >= 1, "logging.print_every", cfg.logging.print_every, "an integer >= 1")
    try:
        str(cfg.run_dir)
    except (KeyError, IndexError, ValueError):
        raise RecipeError(f"{where}: logging.run_dir = {cfg.logging.run_dir!r}: expected a path; the only placeholder is {{name}}") from None

    if check_paths:
        _check_paths(cfg, where)


def check_model_path(mp: str, where: str) -> None:
    """A built-in name that exists, or a local directory with a config.json; hub ids pass."""
    if mp.startswith("builtin:"):
        from trainer.default_model import BUILTIN_MODELS

        if mp not in BUILTIN_MODELS:
            raise RecipeError(f"{where}: model.path = {mp!r}: unknown built-in model; expected one of {', '.join(BUILTIN_MODELS)}")
    elif _looks_local(mp):
        d = Path(mp).expanduser()
        if not d.is_dir():
            raise RecipeError(f"{where}: model.path = {mp!r}: no such directory")
        if not (d / "config.json").is_file():
            raise RecipeError(f"{where}: model.path = {mp!r}: the directory has no config.json (expected a Hugging Face model directory)")


def _check_paths(cfg: RunConfig, where: str) -> None:
    from trainer.data import looks_like_path  # the data loader's own rule for "this is a file"

    mp = cfg.model.path
    check_model_path(mp, where)
    src = cfg.data.source
    if src.startswith("builtin:"):
        if src != "builtin:arithmetic":
            raise RecipeError(f"{where}: data.source = {src!r}: unknown built-in dataset; expected 'builtin:arithmetic'")
    elif _looks_local(src) or looks_like_path(src):
        if not Path(src).expanduser().exists():
            raise RecipeError(f"{where}: data.source = {src!r}: no such file or directory")

    max_pos = model_max_positions(mp)
    need_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if max_pos is not None and need_len > max_pos:
        raise RecipeError(
            f"{where}: rollout.max_new_tokens = {cfg.rollout.max_new_tokens}: data.max_prompt_tokens "
            f"({cfg.data.max_prompt_tokens}) + max_new_tokens = {need_len} exceeds the model's context of {max_pos} tokens"
        )


def correction_config(cfg: RunConfig):
    """The recipe's correction section as parity.correction's own (validating) config."""
    from parity.correction import CorrectionConfig

    c = cfg.parity.correction
    return CorrectionConfig(mode=c.mode, tis_cap=c.tis_cap, low=c.low, high=c.high)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
