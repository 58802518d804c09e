"""A recorded parityrl run's draws made again outside vLLM, and the same run's weights drawn with other seeds.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python bench/learning/emulate_draws.py /tmp/replay40/record-0.pt --sets 16

The recording is bench/learning/bench_replay_vs_trl.py's (``record-<seed>.pt``: every step's prompts, completions and
the LoRA weights after it). Each step is sampled again by the trainer's float32 forward (KV cache, positions from the
attention mask) at the weights the engine sampled with, and vLLM's CPU sampling op (``torch.ops._C.fused_gumbel_argmax``,
what ``TopKTopPSampler.forward_cpu`` calls at temperature 1 without top-k/top-p) with seeds made as the engine makes
them: a ``torch.Generator`` per request seeded with ``rollout.requests.sample_seed(base, sample)``, base = seed *
1000003 + step (trainer/sampling/engines.py), and one ``randint(0, 2**31)`` of it per token as the op's seed.

Set 0 uses the engine's own seeds and must give the recorded completions token for token (it says how many it
does). Sets 1.. shift every step's base by 7919 * set: other draws from the same weights. For each set it prints the
token mean of log p + H (the sampled token's log-prob plus the entropy at its position, float64 from the same
logits): 0 in expectation for a sampler that draws the policy's distribution, positive for a colder one.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: rollout/, trainer/

from peft import set_peft_model_state_dict  # noqa: E402

from rollout.requests import sample_seed  # noqa: E402
from trainer.builtin.resolve import resolve_model_path  # noqa: E402
from trainer.lifecycle.preflight import load_recipe  # noqa: E402
from trainer.models.policy import add_lora, load_base_model, load_tokenizer  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_tiny.yaml"
SHIFT = 7919  # a prime: the other sets' seed bases never meet a step's own


def draw_step(model, prompts: list[list[int]], base: int, max_tokens: int, eos: int
              ) -> tuple[list[list[int]], list[float]]:
    """(completions, log p + H per sampled token) of one step's requests, sampled as the CPU engine samples."""
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C (vLLM's CPU build)

    n, width = len(prompts), max(map(len, prompts))
    gens = [torch.Generator().manual_seed(sample_seed(base, i)) for i in range(n)]
    inp = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out: list[list[int]] = [[] for _ in range(n)]
    excess: list[float] = []
    alive = torch.ones(n, dtype=torch.bool)
    past = None
    with torch.no_grad():
        for _ in range(max_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -inp.shape[1]:]
            o = model(input_ids=inp, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1].float()
            # a finished request draws nothing more from its generator (vLLM drops it from the batch)
            seeds = torch.tensor([int(torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long)) if a else 0
                                  for g, a in zip(gens, alive.tolist())])
            idx = torch.ops._C.fused_gumbel_argmax(logits.contiguous(), seeds).long()
            lp = torch.log_softmax(logits.double(), -1)
            d = lp.gather(-1, idx[:, None])[:, 0] - (lp.exp() * lp).sum(-1)
            for i in range(n):
                if alive[i]:
                    out[i].append(int(idx[i]))
                    excess.append(float(d[i]))
            alive &= idx != eos
            if not alive.any():
                break
            inp = idx[:, None]
            mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype)], 1)
    return out, excess


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("record", type=Path, help="a record-<seed>.pt of bench/learning/bench_replay_vs_trl.py")
    p.add_argument("--sets", type=int, default=4, help="seed sets: 0 the engine's own, 1.. others (default 4)")
    p.add_argument("--max-tokens", type=int, default=24, help="the run's rollout.max_new_tokens (default 24)")
    args = p.parse_args()
    rec = torch.load(args.record, weights_only=False)
    model_dir = resolve_model_path("builtin:tiny")
    eos = load_tokenizer(model_dir).eos_token_id
    model = add_lora(load_base_model(model_dir, "float32"), load_recipe(str(RECIPE), check_paths=False).model.lora)
    model.eval()
    excess: dict[int, list[float]] = {s: [] for s in range(args.sets)}
    same = total = 0
    for k, step in enumerate(rec["steps"]):
        # the engine sampled step k+1 with the weights after step k (the start before step 1)
        set_peft_model_state_dict(model, rec["start"] if k == 0 else rec["steps"][k - 1]["weights"])
        base = rec["seed"] * 1_000_003 + step["step"]
        for s in range(args.sets):
            out, d = draw_step(model, step["prompt_ids"], base + SHIFT * s, args.max_tokens, eos)
            excess[s] += d
            if s == 0:
                same += sum(a == b for a, b in zip(out, step["completion_ids"]))
                total += len(out)
    print(f"seed set 0 (the engine's own seeds) gives {same} of the {total} recorded completions token for token")
    for s, d in excess.items():
        t = torch.tensor(d, dtype=torch.float64)
        print(f"seed set {s}: log p + H {float(t.mean()):+.4f} +- {float(t.std()) / math.sqrt(len(d)):.4f} "
              f"over {len(d)} tokens")
    if args.sets > 1:
        t = torch.tensor([x for s in range(1, args.sets) for x in excess[s]], dtype=torch.float64)
        print(f"sets 1-{args.sets - 1} pooled: {float(t.mean()):+.4f} +- {float(t.std()) / math.sqrt(len(t)):.4f}")


if __name__ == "__main__":
    main()
