"""Value ranges and cross-field rules of a training recipe, checked on the recipe alone before anything heavy
starts (the files and models it names are checked by ``trainer.lifecycle.preflight``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

from parity.corrections import rules as correction_rules
from rollout.completions_scorer import endpoint_url_problem
from rollout.server_engine import parse_server_url
from trainer.config.schema import MAX_STALENESS, RecipeError, RunConfig, recipe_key
from trainer.off_policy import OFF_POLICY

Need = Callable[[bool, str, Any, str], None]
# One section of the validation: raises RecipeError (through ``need`` or its own) for its problems.
Check = Callable[[RunConfig, Need], None]
# (ok, key, value, expected): one rule's verdict, reported as "key = value: expected ..." when not ok.
Rule = tuple[bool, str, Any, str]


def sampling_rules(top_p: float, top_k: int, min_p: float = 0.0, *, prefix: str = "rollout.") -> list[Rule]:
    """The truncation settings' ranges. Any of them on is supported: the engine returns the set of tokens it kept
    at each sampled position and the trainer normalises over it (``parity.logprobs``'s ``support``)."""
    return [
        (0 < top_p <= 1, f"{prefix}top_p", top_p, "a number in (0, 1] (1.0 = off)"),
        (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0 and top_k != 1, f"{prefix}top_k",
         top_k, "0 (off) or an integer >= 2 (1 is greedy decoding: every sample of a prompt would be the same)"),
        (0 <= min_p < 1, f"{prefix}min_p", min_p, "a number in [0, 1) (0.0 = off)"),
    ]


def topk_range(topk: int, *, key: str = "parity.topk") -> Rule:
    """The engine's top-k log-probs per position: 0 (off) to 256."""
    # The top-k costs a [tokens, k] transfer per step; beyond a few hundred the rest
    # bucket is negligible anyway and vLLM's sampler slows down (torch.topk on the vocab).
    return (isinstance(topk, int) and not isinstance(topk, bool) and 0 <= topk <= 256, key, topk,
            "an integer in [0, 256] (0 = off)")


def validate(cfg: RunConfig, where: str = "<recipe>", checks: Iterable[Check] = ()) -> None:
    """Value ranges and cross-field rules, one function per section, then ``checks``: the sections of a
    caller above this package (``trainer.lifecycle.preflight.load_recipe``: the precision recipe's record, which
    ``trainer.precision`` holds), so that their problems join the same report.

    Raises one RecipeError naming every section's first problem (a section stops at its first:
    its later rules may assume the earlier values are sound).
    """

    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise RecipeError(f"{where}: {key} = {value!r}: expected {expected}")

    def server_url(cfg: RunConfig, need: Need) -> None:
        if cfg.rollout.mode == "server":  # the same parser the engine and `parityrl serve` use
            try:
                parse_server_url(cfg.rollout.server_url)
            except ValueError as e:
                raise RecipeError(f"{where}: {e}") from None

    errors: list[RecipeError] = []
    for check in (_check_name, _check_algorithm, _check_rollout, _check_train, _check_model, _check_data, _check_reward,
                  _check_env, _check_eval, _check_parity, _check_teacher, _check_correction, _check_checkpoint_and_logging, server_url,
                  *checks):
        try:
            check(cfg, need)
        except RecipeError as e:
            errors.append(e)
        except Exception:  # a rule tripping over a value already reported as wrong
            if not errors:
                raise
    if errors:
        raise RecipeError.several(errors)


def _check_name(cfg: RunConfig, need: Need) -> None:
    n = cfg.name
    # {name} becomes one folder under logging.run_dir: never a path that leaves it
    need(bool(n) and n not in (".", "..") and not any(c in n for c in "/\\\0") and n == n.strip(), "name", n,
         "one folder name (no '/', '\\', '..' or surrounding spaces)")


def _check_algorithm(cfg: RunConfig, need: Need) -> None:
    """The shared keys, against the record's capabilities (its options checked themselves when built)."""
    a, r = cfg.algorithm, cfg.rollout
    record = a.record
    why = " (a group-relative advantage compares completions of the same prompt)" if record.min_group_size > 1 else ""
    need(a.group_size >= record.min_group_size, "algorithm.group_size", a.group_size,
         f"an integer >= {record.min_group_size} for {a.name}{why}")
    need(not a.dynamic_sampling or record.dynamic_sampling, "algorithm.dynamic_sampling", a.dynamic_sampling,
         f"false for {a.name}: it keeps groups whose rewards differ, a group-relative criterion")
    need(isinstance(a.max_sampling_rounds, int) and a.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds",
         a.max_sampling_rounds, "an integer >= 1 (prompt batches drawn per step with dynamic sampling)")
    need(a.epochs >= 1, "algorithm.epochs", a.epochs, "an integer >= 1")
    need(a.mini_batches >= 1, "algorithm.mini_batches", a.mini_batches, "an integer >= 1")
    samples = r.prompts_per_step * a.group_size
    need(samples % a.mini_batches == 0, "algorithm.mini_batches", a.mini_batches,
         f"a divisor of the {samples} samples per step (rollout.prompts_per_step x algorithm.group_size), "
         "so every optimizer step sees the same number of samples")


def _check_teacher(cfg: RunConfig, need: Need) -> None:
    """On-policy distillation: a teacher exactly when the algorithm or ``algorithm.distill_coef`` reads one (its
    tokenizer against the student's: ``trainer.lifecycle.teacher_checks``, when the models are at hand)."""
    a, t = cfg.algorithm, cfg.teacher
    wants = a.record.teacher or a.distill_coef > 0
    need(isinstance(a.distill_coef, (int, float)) and a.distill_coef >= 0, "algorithm.distill_coef", a.distill_coef,
         "a number >= 0 (0 = no distillation term)")
    need(not (a.record.teacher and a.distill_coef), "algorithm.distill_coef", a.distill_coef,
         f"0 with algorithm.name {a.name}: its advantage is the distillation signal itself")
    need(not a.distill_coef or a.record.token_weights, "algorithm.distill_coef", a.distill_coef,
         f"0 for {a.name}: its loss takes one advantage per sequence, the teacher's signal is one per token")
    need(not wants or bool(t.path), "teacher.path", t.path,
         f"a model with the student's tokenizer for {'algorithm.name ' + a.name if a.record.teacher else 'algorithm.distill_coef'}"
         " (on-policy distillation scores the student's tokens with a teacher)")
    need(wants or not t.path, "teacher.path", t.path,
         "null unless algorithm.name is opd or algorithm.distill_coef > 0 (nothing would read the teacher)")
    need(not (a.record.teacher and a.group_size < 2 and a.options.group_baseline), "algorithm.group_size",
         a.group_size, "an integer >= 2 with group_baseline (the baseline is the group's mean)")
    need(t.engine != "server" or bool(t.server_url), "teacher.server_url", t.server_url,
         "the teacher server's http://HOST:PORT with teacher.engine server (`parityrl serve` of a teacher recipe)")
    need(t.engine != "vllm_url" or bool(t.server_url), "teacher.server_url", t.server_url,
         "a vLLM server's http(s)://HOST[:PORT] with teacher.engine vllm_url (e.g. `vllm serve <teacher.path>`)")
    need(t.engine in ("server", "vllm_url") or t.server_url is None, "teacher.server_url", t.server_url,
         "null unless teacher.engine is server or vllm_url")
    if t.engine == "server" and t.server_url:
        try:  # the parser the server engine uses
            parse_server_url(t.server_url)
        except ValueError:
            need(False, "teacher.server_url", t.server_url, "http://HOST:PORT, e.g. http://127.0.0.1:8001 (no path)")
    if t.engine == "vllm_url" and t.server_url:
        problem = endpoint_url_problem(t.server_url)  # the URL scorer's own rule
        need(problem is None, "teacher.server_url", t.server_url, problem)
    need(t.server_timeout_s > 0, "teacher.server_timeout_s", t.server_timeout_s, "a number of seconds > 0")
    need(t.parity_every is None or (isinstance(t.parity_every, int) and t.parity_every >= 0), "teacher.parity_every",
         t.parity_every, "null (the probe's schedule), 0 (never) or an integer >= 1 (every N steps)")


def _check_rollout(cfg: RunConfig, need: Need) -> None:
    r = cfg.rollout
    need(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, "an integer >= 1")
    need(r.temperature > 0, "rollout.temperature", r.temperature, "a number > 0 (greedy decoding has no log-probs to learn from)")
    for rule in sampling_rules(r.top_p, r.top_k, r.min_p):
        need(*rule)
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "an integer >= 1")
    need(r.kv_cache_memory_bytes is None or r.kv_cache_memory_bytes >= 16 * 1024**2, "rollout.kv_cache_memory_bytes",
         r.kv_cache_memory_bytes, "null (CPU: 256 MiB; CUDA: sized by vLLM from gpu_memory_utilization) or at least 16 MiB")
    need(0 < r.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization", r.gpu_memory_utilization, "a number in (0, 1)")
    need(r.max_num_seqs >= 1, "rollout.max_num_seqs", r.max_num_seqs, "an integer >= 1")
    need(r.sync_chunk_bytes >= 1, "rollout.sync_chunk_bytes", r.sync_chunk_bytes, "an integer >= 1 (bytes)")
    need(r.server_timeout_s > 0, "rollout.server_timeout_s", r.server_timeout_s, "a number of seconds > 0")
    need(r.server_connect_timeout_s > 0, "rollout.server_connect_timeout_s", r.server_connect_timeout_s,
         "a number of seconds > 0")
    need(isinstance(r.max_staleness, int) and 0 <= r.max_staleness <= MAX_STALENESS, "rollout.max_staleness",
         r.max_staleness, f"an integer from 0 (on-policy) to {MAX_STALENESS} (steps off-policy; each pending batch and "
         "its behaviour adapter is held in memory and in every checkpoint)")
    a = cfg.algorithm
    need(a.off_policy in OFF_POLICY, "algorithm.off_policy", a.off_policy, f"one of {sorted(OFF_POLICY)}")
    need(isinstance(a.behaviour_weight_cap, (int, float)) and a.behaviour_weight_cap > 1,
         "algorithm.behaviour_weight_cap", a.behaviour_weight_cap,
         "a number > 1 (tokens whose pi_prox / pi_behaviour exceeds it are left out of a decoupled update)")
    need(isinstance(a.m2_threshold, (int, float)) and a.m2_threshold > 0, "algorithm.m2_threshold", a.m2_threshold,
         "a number > 0 (the mean squared log importance weight an m2po update keeps its tokens below)")
    need(a.off_policy_record.weight is None or a.record.token_weights, "algorithm.off_policy", a.off_policy,
         f"'behaviour_clip' for {a.name}, whose loss weighs whole sequences ({a.off_policy} weighs each token)")
    if r.max_staleness:
        k = r.max_staleness
        need(not a.dynamic_sampling, "algorithm.dynamic_sampling", a.dynamic_sampling,
             f"false with rollout.max_staleness {k} (a prefetched batch is drawn once, not refilled)")
        # decoupled clips pi_theta / pi_prox, pi_prox being the policy before this step's update: with one update per
        # batch pi_theta is pi_prox when that update's gradient is taken, the clip never acts, and the update is an
        # unclipped importance-weighted policy gradient on k-step-old data (measured: the demo at k = 4 fell from
        # held-out 0.711 to 0.012 in 40 steps, bench/RESULTS.md "Learning at staleness"). AReaL runs it with 4
        # mini-batches (ppo_n_minibatches).
        need(a.off_policy != "decoupled" or a.epochs * a.mini_batches > 1, "algorithm.off_policy", a.off_policy,
             f"algorithm.mini_batches or algorithm.epochs above 1 with rollout.max_staleness {k} (decoupled's clip is "
             "anchored to the policy before the step's update, which one update per batch never leaves: the clip "
             "would never act)")
        need(not a.record.critic, "algorithm.name", a.name,
             f"a critic-free algorithm with rollout.max_staleness {k} (the critic's values are not kept per behaviour "
             "policy)")
    need(r.in_flight in ("off", "keep", "recompute"), "rollout.in_flight", r.in_flight, "one of off, keep, recompute")
    if r.in_flight != "off":
        # the weights change in the middle of a generation only where one runs beside training: a server, with
        # batches launched ahead (trainer/sampling/in_flight.py); a colocated engine generates between updates
        need(r.mode == "server", "rollout.in_flight", r.in_flight,
             f"'off' with rollout.mode {r.mode} (a colocated engine generates between updates, never during one; "
             "in-flight updates need rollout.mode: server)")
        need(r.max_staleness >= 1, "rollout.in_flight", r.in_flight,
             "'off' with rollout.max_staleness 0 (nothing is generating while the trainer updates; set "
             "rollout.max_staleness >= 1)")
        need(r.lora_sync != "adapter", "rollout.lora_sync", r.lora_sync,
             f"'merged' or 'auto' with rollout.in_flight {r.in_flight} (a running request keeps the adapter it was "
             "started with; an in-flight update replaces the weights it runs on)")
        # exact mode's engine log-probs are the trainer's own kernel's over the same context: a token sampled over
        # another version's KV has no single set of weights whose forward reproduces it
        need(not (r.in_flight == "keep" and cfg.precision.recipe == "exact"), "rollout.in_flight", r.in_flight,
             "'recompute' or 'off' with precision.recipe exact (keep continues on KV of older weights, which no "
             "single version's forward reproduces bit for bit)")
    # A server is a vLLM server started by `parityrl serve`: the HF engine cannot be served (what a
    # precision recipe cannot run on a server, its record says: trainer.precision).
    need(r.mode != "server" or r.engine == "vllm", "rollout.mode", r.mode,
         f"'colocate' with rollout.engine {r.engine} (server mode runs a vLLM server)")


def check_cpu_threads(t, need: Need) -> None:
    """``train.cpu_threads`` of any stage's ``train:`` section."""
    need(t.cpu_threads is None or t.cpu_threads >= 1, "train.cpu_threads", t.cpu_threads, "an integer >= 1 or null")


def _check_train(cfg: RunConfig, need: Need) -> None:
    t = cfg.train
    need(t.steps >= 1, "train.steps", t.steps, "an integer >= 1")
    need(t.learning_rate > 0, "train.learning_rate", t.learning_rate, "a number > 0")
    need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "a number >= 0")
    need(len(t.adam_betas) == 2 and all(0 <= b < 1 for b in t.adam_betas), "train.adam_betas", t.adam_betas,
         "two numbers in [0, 1)")
    need(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "an integer >= 1")
    # transformers' flash-attention path finds packed sequences only in a one-row batch (trainer/models/packing.py)
    need(not (t.pack_sequences and cfg.model.attn_implementation == "flash_attention_2"), "train.pack_sequences",
         t.pack_sequences, "false with model.attn_implementation flash_attention_2 (packing needs sdpa or eager)")
    need(t.max_grad_norm > 0, "train.max_grad_norm", t.max_grad_norm, "a number > 0")
    need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "an integer >= 0")
    need(0 <= t.warmup_ratio < 1, "train.warmup_ratio", t.warmup_ratio, "a number in [0, 1)")
    need(not (t.warmup_steps and t.warmup_ratio), "train.warmup_ratio", t.warmup_ratio,
         f"0 when train.warmup_steps is set ({t.warmup_steps}): one of the two")
    check_cpu_threads(t, need)
    need(t.update_cpu_threads is None or t.update_cpu_threads >= 1, "train.update_cpu_threads", t.update_cpu_threads,
         "an integer >= 1 or null")
    # accelerate's set_seed seeds NumPy, whose seeds are unsigned 32-bit (np.random.seed raises outside)
    need(0 <= t.seed < 2**32, "train.seed", t.seed, f"an integer in [0, {2**32 - 1}] (NumPy's seed range)")


def _check_model(cfg: RunConfig, need: Need) -> None:
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


def _check_data(cfg: RunConfig, need: Need) -> None:
    d = cfg.data
    need(d.max_prompt_tokens >= 1, "data.max_prompt_tokens", d.max_prompt_tokens, "an integer >= 1")
    need(d.num_examples is None or d.num_examples >= 1, "data.num_examples", d.num_examples, "null or an integer >= 1")
    need(not d.image_processor or d.image_column is not None, "data.image_processor", d.image_processor,
         "{} without data.image_column (the settings are the images' processor's)")
    if d.image_column is not None:  # what a vision-language run is built for so far (docs/vision-language.md)
        r = cfg.rollout
        need(bool(d.image_column), "data.image_column", d.image_column, "a column name, or null for text prompts")
        need(d.max_images_per_prompt >= 1, "data.max_images_per_prompt", d.max_images_per_prompt, "an integer >= 1")
        need(r.engine == "vllm", "data.image_column", d.image_column,
             f"null with rollout.engine {r.engine!r}: images go to the vLLM engine (colocated or a server) only")
        need(r.in_flight == "off", "rollout.in_flight", r.in_flight, "'off' with data.image_column (a push in the "
             "middle of a generation would empty the encoder cache under running requests that hold images)")
        need(not cfg.env.enabled, "data.image_column", d.image_column, "null with env: (multi-turn episodes with "
             "images are not supported)")
        need(not cfg.train.pack_sequences, "data.image_column", d.image_column, "null with train.pack_sequences "
             "(images are placed by prompt; packing is refused for vision-language batches)")


def _check_reward(cfg: RunConfig, need: Need) -> None:
    rw = cfg.reward
    need(len(rw.functions) + len(rw.models) > 0 or cfg.env.class_ is not None, "reward.functions", rw.functions,
         "at least one name: 'module:function' (or a reward model under reward.models, or an env.class whose steps "
         "give rewards)")
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
        longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens + 1
        need(rm.max_tokens is None or rm.max_tokens >= longest, f"{key}.max_tokens", rm.max_tokens,
             f"null or at least data.max_prompt_tokens + rollout.max_new_tokens + 1 (EOS) = {longest}")
    t = rw.timeout_s
    need(t is None or (not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(t) and t > 0),
         "reward.timeout_s", t, "null (no limit) or a number of seconds > 0")
    sources = list(rw.functions) + list(rw.models)
    for name in rw.weights:
        need(name in sources, f"reward.weights.{name}", rw.weights[name],
             "a weight for a name listed in reward.functions or reward.models (" + ", ".join(sources) + ")")


def _check_env(cfg: RunConfig, need: Need) -> None:
    e = cfg.env
    if not e.enabled:
        return
    need(e.class_ is None or e.tools is None, "env.tools", e.tools,
         f"null with env.class set ({e.class_!r}): exactly one of env.class / env.tools (a class that offers tools "
         "builds its own trainer.environments.tools.ToolEnvironment)")
    for key, spec in (("env.class", e.class_), ("env.tools", e.tools)):
        need(spec is None or (spec.count(":") == 1 and all(p.strip() for p in spec.split(":"))), key, spec,
             "'module:Name', 'path/to/file.py:Name' or 'builtin:<name>'")
    need(e.max_turns >= 1, "env.max_turns", e.max_turns, "an integer >= 1 (assistant turns per episode)")
    need(e.max_observation_tokens >= 1, "env.max_observation_tokens", e.max_observation_tokens, "an integer >= 1")
    shortest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    need(e.max_tokens is None or e.max_tokens >= shortest, "env.max_tokens", e.max_tokens,
         f"null or at least data.max_prompt_tokens + rollout.max_new_tokens = {shortest} (one whole first turn)")
    t = e.timeout_s
    need(t is None or (not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(t) and t > 0),
         "env.timeout_s", t, "null (no limit) or a number of seconds > 0")
    need(not cfg.reward.models, "reward.models", sorted(cfg.reward.models),
         "none with env set: a reward model scores one prompt and one completion as text, not an episode "
         "(use reward.functions, which receive the episode's messages)")
    need("env" not in cfg.reward.functions, "reward.functions.env", cfg.reward.functions.get("env"),
         "another name: reward/env is the environment's summed step rewards")


def _check_eval(cfg: RunConfig, need: Need) -> None:
    e = cfg.eval
    need(e.every >= 0, "eval.every", e.every, "an integer >= 0 (steps between evaluations; 0 = off)")
    if not e.every:
        return
    need(e.num_prompts >= 1, "eval.num_prompts", e.num_prompts, "an integer >= 1")
    need(e.samples >= 0, "eval.samples", e.samples, "an integer >= 0 (completions per prompt; 0 = greedy only)")
    need(e.samples > 0 or e.greedy, "eval.samples", e.samples, "at least 1 with eval.greedy false (nothing to evaluate)")
    need(e.samples == 0 or e.temperature > 0, "eval.temperature", e.temperature,
         "a number > 0 (eval.greedy asks for greedy completions)")
    for j in e.pass_k:
        need(1 <= j <= e.samples, "eval.pass_k", e.pass_k,
             f"integers in [1, eval.samples = {e.samples}]: pass@j needs j of the samples drawn per prompt")
    fns = list(cfg.reward.functions) + list(cfg.reward.models)
    need(e.success_reward is None or e.success_reward in fns, "eval.success_reward", e.success_reward,
         "null or one of reward.functions / reward.models (" + ", ".join(fns) + ")")
    need(math.isfinite(e.success_threshold), "eval.success_threshold", e.success_threshold, "a finite number")
    need(bool(fns) or e.success_reward is not None, "eval.success_reward", e.success_reward,
         "a reward function to judge success by (the recipe has none)")


def sequence_length(cfg: RunConfig) -> int:
    """The longest sequence the rollout engine reads: a prompt and its completion, or with ``env`` an episode's
    budget (``episode_max_tokens``). The engine's context (``max_model_len``) is made this long."""
    if cfg.env.enabled:
        return episode_max_tokens(cfg)
    return cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


def episode_max_tokens(cfg: RunConfig) -> int:
    """An episode's token budget (env.max_tokens, or its default: the prompt and every turn with its longest reply);
    the rollout engine's context is made this long."""
    e = cfg.env
    if e.max_tokens is not None:
        return e.max_tokens
    return cfg.data.max_prompt_tokens + e.max_turns * (cfg.rollout.max_new_tokens + e.max_observation_tokens)


def _check_parity(cfg: RunConfig, need: Need) -> None:
    p = cfg.parity
    need(p.chunk_size is None or p.chunk_size >= 1, "parity.chunk_size", p.chunk_size, "null or an integer >= 1")
    for key in ("max_mae", "max_kl_k3"):
        v = getattr(p, key)
        need(v is None or v > 0, f"parity.{key}", v, "null or a number > 0")
    ratio = cfg.parity.max_mae_ratio
    need(ratio is None or ratio > 1, "parity.max_mae_ratio", ratio, "null or a number > 1 (a multiple of the probe's level)")
    need(*topk_range(p.topk))
    need(p.probe_prompts >= 0, "parity.probe_prompts", p.probe_prompts, "an integer >= 0 (0 = off)")
    need(p.probe_every >= 1, "parity.probe_every", p.probe_every, "an integer >= 1 (syncs between probes)")
    need(p.probe_first >= 0, "parity.probe_first", p.probe_first, "an integer >= 0 (first syncs always probed)")
    need(p.unreplayed_every >= 0, "parity.unreplayed_every", p.unreplayed_every, "an integer >= 0 (0 = never)")


def _check_correction(cfg: RunConfig, need: Need) -> None:
    """The correction against the algorithm's record and the loop: what each rule's weights need from the loss, what
    bypass needs from the updates (the rules and their options checked themselves when the section was read)."""
    c, a = cfg.parity.correction, cfg.algorithm
    record, plan = a.record, c.plan
    sequence_rules = ", ".join(r.name for r in correction_rules() if r.level == "sequence")
    need(plan.level == "sequence" or record.token_weights, "parity.correction.rule", c.rule,
         f"rules with one weight per sequence for {a.name}, whose loss weighs whole sequences: {sequence_rules}")
    if c.bypass:
        updates = a.epochs * a.mini_batches
        need(updates == 1, "parity.correction.bypass", True,
             f"false with algorithm.epochs x mini_batches = {updates} updates per batch: each takes its ratio "
             "against the trainer's pi_old, scored before the first (bypass would replace it by the engine's)")
        need(not record.critic, "parity.correction.bypass", True,
             f"false for {a.name}: its critic's values and pi_old come from the trainer's pass before the update")
        need(not cfg.rollout.max_staleness, "parity.correction.bypass", True,
             f"false with rollout.max_staleness {cfg.rollout.max_staleness}: pi_old is the behaviour adapter's pass, "
             "which parity/* measures")
        need(plan.weight_rule is None, "parity.correction.rule", c.rule,
             "rejection rules only with parity.correction.bypass: PPO's ratio pi_theta / pi_rollout is then the "
             "importance weight (verl's bypass_ppo_clip)")
    need(not c.unbiased_kl or record.uses_reference(a.options), "parity.correction.unbiased_kl", True,
         f"false with algorithm.kl_coef 0 ({a.name}): there is no KL term to weight")


def _check_checkpoint_and_logging(cfg: RunConfig, need: Need) -> None:
    need(cfg.checkpoint.every >= 0, "checkpoint.every", cfg.checkpoint.every, "an integer >= 0")
    need(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", cfg.checkpoint.keep_last, "an integer >= 1")
    need(cfg.logging.breakdown_every >= 1, "logging.breakdown_every", cfg.logging.breakdown_every, "an integer >= 1")
    need(cfg.logging.print_every >= 1, "logging.print_every", cfg.logging.print_every, "an integer >= 1")
    need(cfg.logging.samples_every >= 0, "logging.samples_every", cfg.logging.samples_every, "an integer >= 0 (0 = off)")
    need(cfg.logging.samples_per_step >= 1, "logging.samples_per_step", cfg.logging.samples_per_step,
         "an integer >= 1")
    try:
        str(cfg.run_dir)
    except (KeyError, IndexError, ValueError):
        need(False, "logging.run_dir", cfg.logging.run_dir, "a path; the only placeholder is {name}")


def to_dict(cfg) -> dict:
    """The config as plain data, as a recipe writes it: the ``algorithm`` section flat (options inlined), each
    correction rule's options under ``parity.correction.<rule>``."""
    out = _recipe_keys(cfg, dataclasses.asdict(cfg))
    alg = out.get("algorithm")
    if isinstance(alg, dict) and "options" in alg:
        options = alg.pop("options") or {}
        out["algorithm"] = {**alg, **options}
    correction = out.get("parity", {}).get("correction")
    if isinstance(correction, dict) and "options" in correction:  # each rule's options under its name
        options = correction.pop("options") or {}
        out["parity"]["correction"] = {**correction, **options}
    return out


def _recipe_keys(cfg, tree: dict) -> dict:
    """``dataclasses.asdict(cfg)`` (``tree``) with its fields named as recipe keys (``schema.recipe_key``: ``class_``
    -> ``class``); keys inside mappings the user wrote (reward names, template variables) are left alone."""
    out = {}
    for f in dataclasses.fields(cfg):
        value, sub = tree[f.name], getattr(cfg, f.name)
        out[recipe_key(f.name)] = _recipe_keys(sub, value) if dataclasses.is_dataclass(sub) else value
    return out
