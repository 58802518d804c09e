"""Where the engine's and the trainer's bits part: mae after each piece of exact mode, one at a time.

    PYTHONPATH=. python bench/parity/exact_staircase.py --model builtin:tiny --dtype bfloat16
    PYTHONPATH=. python bench/parity/exact_staircase.py --model builtin:smollm2-135m --dtype float32

One exact-mode engine (rollout.vllm_plugins.exact_quant) holds the model after a LoRA "update" (random
adapter, merged by the sync's arithmetic) and samples completions. Their log-probs are then
computed by:

  trainer today   the trainer's HF + PEFT forward and fused log-prob kernel (float32 LoRA branch)
  0 reference     a torch restatement of HF's ops (separate q/k/v GEMMs, HF RMSNorm and residual
                  adds, HF RoPE tables, SDPA, the fused chunked log-softmax) on the merged weights
                  the engine holds  -> the LoRA piece
  + 2 matmuls     ... with the engine's GEMM on its fused matrices
  + 3 norms/RoPE  ... and vLLM's RMSNorm (residual add fused) and rotary kernel
  + 4 attention   ... and vLLM's CPU attention over a paged cache
  + 5 lm_head     ... and the engine's lm_head GEMM + float32 log_softmax  (= rollout.engine_forward)

and the mean / max |engine - that| over the sampled tokens is printed per row, cumulative.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from rollout.engine_forward import EngineForward  # noqa: E402

PIECES = ("matmuls", "norms", "attention", "lm_head")


class StaircaseForward(EngineForward):
    """EngineForward with the pieces not in ``engine_pieces`` done as HF's modules do them."""

    def __init__(self, engine, config, hf_model, engine_pieces: set[str]) -> None:
        super().__init__(engine, config)
        self.hf_rotary = hf_model.model.rotary_emb
        self.use = engine_pieces

    def set_weights(self, named, version=None) -> None:
        super().set_weights(named, version)
        self.raw = {k.removeprefix("model."): v for k, v in named.items()}
        self.raw.setdefault("lm_head.weight", self.embed)

    def _norm(self, x, w):
        if "norms" in self.use:
            return super()._norm(x, w)
        xf = x.to(torch.float32)  # transformers' LlamaRMSNorm
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _add_norm(self, x, residual, w):
        if "norms" in self.use:
            return super()._add_norm(x, residual, w)
        residual = residual + x  # HF: the add in the model dtype, then the norm
        return self._norm(residual, w), residual

    def _linear(self, name, x):
        if "matmuls" in self.use:
            return super()._linear(name, x)
        p, _, leaf = name.rpartition(".")
        parts = {"qkv_proj": ("self_attn.", ("q_proj", "k_proj", "v_proj")),
                 "gate_up_proj": ("mlp.", ("gate_proj", "up_proj")),
                 "o_proj": ("self_attn.", ("o_proj",)), "down_proj": ("mlp.", ("down_proj",))}[leaf]
        mod, shards = parts
        return torch.cat([torch.nn.functional.linear(x, self.raw[f"{p}.{mod}{s}.weight"],
                                                     self.raw.get(f"{p}.{mod}{s}.bias")) for s in shards], -1)

    def _rope(self, positions, q, k):
        if "norms" in self.use:
            return super()._rope(positions, q, k)
        cos, sin = self.hf_rotary(q[None], position_ids=positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]

        def rot(t, heads):
            t = t.reshape(-1, heads, self.head_dim)
            half = self.head_dim // 2
            rotated = torch.cat((-t[..., half:], t[..., :half]), -1)
            return (t * cos + rotated * sin).reshape(t.shape[0], -1)

        return rot(q, self.num_heads), rot(k, self.num_kv_heads)

    def _attention(self, q, k, v, meta):
        if "attention" in self.use:
            return super()._attention(q, k, v, meta)
        out, rep = [], self.num_heads // self.num_kv_heads
        for s, e in zip(meta["qsl"][:-1].tolist(), meta["qsl"][1:].tolist()):
            qs = q[s:e].reshape(e - s, self.num_heads, self.head_dim).transpose(0, 1)[None]
            ks = k[s:e].reshape(e - s, self.num_kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(rep, 0)[None]
            vs = v[s:e].reshape(e - s, self.num_kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(rep, 0)[None]
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            out.append(o[0].transpose(0, 1).reshape(e - s, -1))
        return torch.cat(out)

    def _head(self, h, targets, temperature):
        if "lm_head" in self.use:
            return super()._head(h, targets, temperature)
        from parity.logprobs import fused_logprobs

        lp, _ = fused_logprobs(h[None], self.raw["lm_head.weight"], targets[None], temperature=temperature)
        return lp[0].float(), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lora-std", type=float, default=0.02, help="std of the random LoRA B (A keeps PEFT's init)")
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import rollout.vllm_plugins.exact_quant  # noqa: F401
    from rollout.types import SamplingSpec
    from rollout.vllm_engine import VLLMEngine
    from rollout.vllm_plugins.names import EXACT
    from rollout.weight_export import effective_state, merged_lora_weights
    from trainer.builtin.resolve import resolve_model_path
    from trainer.models.batch import build_token_batch
    from trainer.models.policy import completion_logprobs, load_tokenizer

    model_dir = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    policy = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, args.lora_std)
    tok = load_tokenizer(model_dir)
    texts = [f"What is {i + 3} plus {2 * i + 1}?" for i in range(args.prompts)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    engine = VLLMEngine(model_dir, dtype=args.dtype, max_model_len=max(len(p) for p in prompts) + args.max_new_tokens + 2,
                        kv_cache_memory_bytes=256 * 1024**2, quantization=EXACT)
    engine.load_weights(merged_lora_weights(policy, dtype=dtype))
    r = engine.generate(prompts, SamplingSpec(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1))
    seqs = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
    starts = [len(p) for p in r.prompt_ids]
    engine_lp = torch.cat([torch.tensor(x, dtype=torch.float32) for x in r.rollout_logprobs])
    n_tok = engine_lp.numel()

    def report(label: str, lps: list[torch.Tensor]) -> None:
        d = (torch.cat(lps) - engine_lp).abs()
        print(f"{label:<34} mae {d.mean().item():.3e}   max {d.max().item():.3e}   equal {int((d == 0).sum())}/{n_tok}",
              flush=True)

    print(f"{args.model} {args.dtype}: {len(seqs)} samples, {n_tok} sampled tokens (LoRA r 8 all-linear, B ~ "
          f"N(0, {args.lora_std}))", flush=True)
    batch = build_token_batch(r.prompt_ids, r.completion_ids, pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(policy.eval(), batch, temperature=1.0)
    report("trainer today (HF + PEFT)", [lp[i, :len(c)] for i, c in enumerate(r.completion_ids)])
    state = effective_state(policy, dtype=dtype)
    used: set[str] = set()
    for label, piece in [("0 reference on merged weights", None), ("+ 2 engine GEMMs", "matmuls"),
                         ("+ 3 engine RMSNorm/RoPE", "norms"), ("+ 4 engine attention", "attention"),
                         ("+ 5 engine lm_head/log_softmax", "lm_head")]:
        if piece:
            used.add(piece)
        fwd = StaircaseForward(engine, base.config, base, set(used))
        fwd.set_weights(state)
        report(label, fwd.logprobs(seqs, starts))
    engine.close()


if __name__ == "__main__":
    main()
