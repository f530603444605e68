"""Train one small MoE language model of the sample set on the 5-domain corpus.

    python scripts/samples/train_model.py --corpus build/corpus --tokenizer build/tokenizer \
        --out build/runs/mixtral-healthy --arch mixtral --balance per-layer [--steps 1000] [--threads 1]

Balancing (`--balance`):
- `per-layer`: a Switch/GShard loss computed per MoE layer and averaged (transformers' built-in
  `router_aux_loss_coef` pools all layers into one load and leaves single layers imbalanced);
- `none`: no balancing at all;
- `inverted`: the per-layer loss with a negative coefficient, which rewards concentration: used to
  induce a collapse on purpose;
- `bias`: DeepSeek-V3 auxiliary-loss-free balancing: after each step each layer's per-expert selection bias
  moves by `bias_rate · sign(mean load − load)` (arXiv 2408.15664, DeepSeek-V3 report §2.1.2).

Deterministic for a given seed and thread count. Checkpoints (`--checkpoints 0,25,...`) and the final model
are saved as fp16 Hugging Face folders with the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DOMAINS = ("english", "python", "bible_en", "bible_es", "data")
LONG_CONTEXT = 32_768  # context of the Mixtral samples (sliding-window attention)


def build_config(arch: str, vocab: int, tokenizer, small: bool, seq: int = 256):
    """The two sample architectures (or tiny versions of them for the CI smoke run)."""
    from transformers import DeepseekV3Config, MixtralConfig

    d, layers, ffn = (32, 2, 32) if small else (128, 4, 128)
    special = dict(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        vocab_size=vocab,
    )
    if arch == "mixtral":
        return MixtralConfig(
            hidden_size=d,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.0,  # balancing is ours, per layer
            # A sliding window as long as the training sequences: identical to full attention on every
            # training sequence, and every relative position stays one that training saw, so the model
            # stays in distribution up to a long context (the app's 32k-token views run on it).
            **{**special, "max_position_embeddings": LONG_CONTEXT},
            sliding_window=seq,
        )
    if arch == "deepseek_v3":
        return DeepseekV3Config(
            hidden_size=d,
            intermediate_size=2 * ffn,
            moe_intermediate_size=ffn // 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=32,
            **special,
        )
    raise SystemExit(f"unknown --arch {arch!r} (mixtral | deepseek_v3)")


def load_domains(corpus: Path, tokenizer, split: str) -> dict[str, np.ndarray]:
    out = {}
    for domain in DOMAINS:
        path = corpus / domain / f"{split}.txt"
        if not path.is_file():
            raise SystemExit(f"corpus file {path} is missing: build the corpus first (build_corpus.py)")
        ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
        out[domain] = np.asarray(ids, dtype=np.int64)
    return out


def sample_batch(data: dict[str, np.ndarray], rng: np.random.Generator, batch: int, seq: int) -> torch.Tensor:
    """Random windows; every domain equally likely (domains differ ~2x in size)."""
    rows = []
    for _ in range(batch):
        ids = data[DOMAINS[rng.integers(len(DOMAINS))]]
        start = rng.integers(0, len(ids) - seq - 1)
        rows.append(ids[start : start + seq])
    return torch.from_numpy(np.stack(rows))


def switch_loss(logits: torch.Tensor, top_k: int, score_fn: str) -> torch.Tensor:
    """Switch/GShard balancing loss of one layer: E · Σ_e f_e · P_e, f_e = share of top-k slots on e,
    P_e = mean router probability of e. 1.0 when perfectly balanced."""
    probs = torch.softmax(logits.float(), -1) if score_fn == "softmax" else torch.sigmoid(logits.float())
    probs = probs / probs.sum(-1, keepdim=True)
    n_experts = probs.shape[-1]
    chosen = torch.topk(probs, top_k, dim=-1).indices
    f = F.one_hot(chosen, n_experts).float().sum(1).mean(0) / top_k
    return n_experts * (f * probs.mean(0)).sum()


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class BiasBalancer:
    """DeepSeek-V3 loss-free balancing: counts each layer's dispatched experts with a pre-hook on the
    experts module, then nudges the selection bias towards equal load after each step."""

    def __init__(self, model, rate: float):
        self.rate = rate
        self.blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
        self.counts = [None] * len(self.blocks)
        self.handles = [
            block.experts.register_forward_pre_hook(self._hook(i)) for i, block in enumerate(self.blocks)
        ]

    def _hook(self, index: int):
        def hook(module, args):
            top_k_index = args[1]
            self.counts[index] = torch.bincount(top_k_index.reshape(-1), minlength=module.num_experts)

        return hook

    @torch.no_grad()
    def update(self) -> None:
        for block, counts in zip(self.blocks, self.counts, strict=True):
            load = counts.float()
            block.gate.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def save(model, tokenizer, folder: Path, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    half = type(model)(model.config)
    half.load_state_dict(model.state_dict())
    half.to(torch.float16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", choices=["mixtral", "deepseek_v3"], default="mixtral")
    parser.add_argument("--balance", choices=["per-layer", "none", "inverted", "bias"], default="per-layer")
    parser.add_argument("--aux-coef", type=float, default=0.01, help="per-layer balancing loss weight")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="bias update speed γ (--balance bias)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--checkpoints", default="", help="comma-separated steps to save (0 = init)")
    parser.add_argument("--small", action="store_true", help="tiny sizes for the CI smoke run")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    data = load_domains(args.corpus, tokenizer, "train")
    config = build_config(args.arch, len(tokenizer), tokenizer, args.small, args.seq)
    model = AutoModelForCausalLM.from_config(config).train()
    balancer = BiasBalancer(model, args.bias_rate) if args.balance == "bias" else None
    coef = {"per-layer": args.aux_coef, "none": 0.0, "inverted": -args.aux_coef, "bias": 0.0}[args.balance]
    score_fn = "sigmoid" if args.arch == "deepseek_v3" else "softmax"
    top_k = config.num_experts_per_tok
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    rng = np.random.default_rng(args.seed)
    checkpoints = {int(s) for s in args.checkpoints.split(",") if s.strip()}
    meta = dict(vars(args), corpus=str(args.corpus), tokenizer=str(args.tokenizer), out=str(args.out))
    log = []
    start = time.time()
    for step in range(args.steps + 1):
        if step in checkpoints:
            save(model, tokenizer, args.out / "checkpoints" / f"step-{step:05d}", {**meta, "step": step})
        if step == args.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        ids = sample_batch(data, rng, args.batch, args.seq)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        balance = torch.stack([switch_loss(lg, top_k, score_fn) for lg in out.router_logits]).mean()
        loss = out.loss + coef * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if balancer is not None:
            balancer.update()
        if step % 25 == 0 or step == args.steps - 1:
            entry = {
                "step": step,
                "lm_loss": round(out.loss.item(), 4),
                "balance": round(balance.item(), 4),
                "seconds": round(time.time() - start, 1),
            }
            log.append(entry)
            print(json.dumps(entry), flush=True)
    if balancer is not None:
        balancer.close()
    meta.update(seconds=round(time.time() - start, 1), log=log)
    save(model.eval(), tokenizer, args.out / "final", {**meta, "step": args.steps})
    print(f"saved {args.out / 'final'} after {meta['seconds']} s")


if __name__ == "__main__":
    main()
