"""The same decoder and train step in PyTorch, timed: ``python benchmarks/torch_reference.py --config X``.

Our own PyTorch port of ``models/llama.py`` (RMSNorm, HF rotate_half rotary,
grouped-query attention through ``F.scaled_dot_product_attention``, SwiGLU,
untied LM head, std-0.02 init with GPT-2 residual scaling) and of jaxtrain's
step: cross-entropy, global-norm clipping, AdamW (decay on matrices only,
warmup-cosine LR), on the same batches from jaxtrain's data pipeline (same
global batch and sequence length; grad_accum must be 1). The parameter count
is checked against jaxtrain's (must agree within 1%).

``--mode eager`` or ``--mode compile`` (``torch.compile`` of the model;
the optimizer step stays eager, as most users run it). Needs the benchmark
extra: ``pip install -e ".[bench]"``. ``--serve`` is compare.py's worker mode.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench import fmt, peak_host_rss_bytes, print_table, serve, stats, with_corpus, write_json
from torch import nn  # noqa: E402

from jaxtrain import config as cfglib  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def rotary_tables(seq: int, hd: int, theta: float):
    half = hd // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32) / half))
    ang = torch.arange(seq, dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], -1)  # [T, hd]
    return ang.cos()[None, None], ang.sin()[None, None]  # [1, 1, T, hd]


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Block(nn.Module):
    def __init__(self, m, std: float, out_std: float):
        super().__init__()
        self.h, self.kvh, self.hd = m.n_heads, m.n_kv_heads, m.head_dim
        self.attn_norm, self.mlp_norm = RMSNorm(m.d_model, m.norm_eps), RMSNorm(m.d_model, m.norm_eps)
        self.wq = nn.Linear(m.d_model, self.h * self.hd, bias=False)
        self.wk = nn.Linear(m.d_model, self.kvh * self.hd, bias=False)
        self.wv = nn.Linear(m.d_model, self.kvh * self.hd, bias=False)
        self.wo = nn.Linear(self.h * self.hd, m.d_model, bias=False)
        self.w_gate = nn.Linear(m.d_model, m.d_ff, bias=False)
        self.w_up = nn.Linear(m.d_model, m.d_ff, bias=False)
        self.w_down = nn.Linear(m.d_ff, m.d_model, bias=False)
        for lin in (self.wq, self.wk, self.wv, self.w_gate, self.w_up):
            nn.init.normal_(lin.weight, std=std)
        for lin in (self.wo, self.w_down):
            nn.init.normal_(lin.weight, std=out_std)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.attn_norm(x)
        q = self.wq(y).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.wk(y).view(b, t, self.kvh, self.hd).transpose(1, 2)
        v = self.wv(y).view(b, t, self.kvh, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kvh != self.h)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, self.h * self.hd))
        y = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))


class Llama(nn.Module):
    """tokens [batch, length] int64 -> logits [batch, length, vocab] float32."""

    def __init__(self, m, vocab: int, seq: int):
        super().__init__()
        out_std = m.init_std / math.sqrt(2 * m.n_layers)
        self.embed = nn.Embedding(vocab, m.d_model)
        nn.init.normal_(self.embed.weight, std=m.init_std)
        self.layers = nn.ModuleList([Block(m, m.init_std, out_std) for _ in range(m.n_layers)])
        self.final_norm = RMSNorm(m.d_model, m.norm_eps)
        self.lm_head = nn.Linear(m.d_model, vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=m.init_std)
        cos, sin = rotary_tables(seq, m.head_dim, m.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, self.cos, self.sin)
        return self.lm_head(self.final_norm(x))


def lr_at(cfg, step: int) -> float:
    """jaxtrain's schedule: step s trains with warmup-cosine(s + 1) (optax warmup_cosine_decay_schedule)."""
    o, c = cfg.optimizer, step + 1
    decay = max(cfg.decay_steps, o.warmup_steps + 1)
    if c < o.warmup_steps:
        return o.lr * c / o.warmup_steps
    frac = min(1.0, (c - o.warmup_steps) / (decay - o.warmup_steps))
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


class TorchBench:
    def __init__(self, config, overrides: list[str], mode: str, n_batches: int = 8):
        from jaxtrain import data as datalib  # the same batches as jaxtrain
        self.cfg = cfg = cfglib.load(config, with_corpus(overrides))
        if cfg.train.grad_accum != 1:
            raise SystemExit("torch_reference: train.grad_accum must be 1")
        if cfg.model.dtype != "float32":
            raise SystemExit("torch_reference: CPU reference runs float32 only")
        torch.manual_seed(cfg.train.seed)
        data = datalib.load(cfg)
        self.vocab = cfg.model.vocab_size or data.tokenizer.vocab_size
        import jax
        one = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",)),
                                         jax.sharding.PartitionSpec())
        it = data.iterator(one)  # batch dicts of [1, global_batch, T] inputs/targets
        self.batches = []
        for _ in range(n_batches):
            b = next(it)
            self.batches.append(tuple(torch.from_numpy(np.asarray(b[k]).reshape(-1, cfg.data.seq_len).astype(np.int64))
                                      for k in ("inputs", "targets")))
        self.model = Llama(cfg.model, self.vocab, cfg.data.seq_len)
        params = list(self.model.parameters())
        self.n_params = sum(p.numel() for p in params)
        o = cfg.optimizer
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        # foreach: torch's multi-tensor AdamW (what torchtitan runs); the faster of its CPU options here.
        self.opt = torch.optim.AdamW(groups, lr=lr_at(cfg, 0), betas=(o.b1, o.b2), eps=o.eps, foreach=True)
        self.fwd = torch.compile(self.model) if mode == "compile" else self.model
        self.mode = mode
        self.step = 0
        self.last_loss = None
        t0 = time.perf_counter()
        self.run(1)  # torch.compile compiles on the first call
        self.compile_s = time.perf_counter() - t0
        self.n_jax, self.fpt = jax_reference(cfg, self.vocab)
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len

    def train_step(self, batch):
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.cfg, self.step)
        inputs, targets = batch
        logits = self.fwd(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.clip_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss.detach()

    def run(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            batch = self.batches[self.step % len(self.batches)]
            t = time.perf_counter()
            loss = float(self.train_step(batch))
            times.append(time.perf_counter() - t)
            self.last_loss = loss
        return times


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """torch f32 n^3 matmul FLOP/s now (best of ``repeats``)."""
    a = torch.ones(n, n)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def jax_reference(cfg, vocab: int) -> tuple[int, float]:
    """jaxtrain's parameter count and FLOPs per token, from its run setup on one device (no compile)."""
    import jax

    from jaxtrain.train import setup
    from jaxtrain.train.step import count_params
    one = cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"data": 1, "fsdp": 1, "tensor": 1,
                                                                     "sequence": 1, "expert": 1})})
    s = setup(one, jax.devices("cpu")[:1], vocab=vocab)
    return count_params(s.abstract_state()["params"]), s.model_spec.flops_per_unit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="shakespeare_char")
    p.add_argument("--mode", choices=("eager", "compile"), default="eager")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--serve", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    b = TorchBench(args.config, args.overrides, args.mode)
    n_jax = b.n_jax
    if abs(b.n_params - n_jax) > 0.01 * n_jax:
        raise SystemExit(f"torch_reference: {b.n_params} parameters vs jaxtrain's {n_jax}: more than 1% apart")
    info = {"impl": f"torch-{args.mode}", "config": args.config, "overrides": args.overrides, "device": "cpu",
            "threads": torch.get_num_threads(), "n_params": b.n_params, "jax_n_params": n_jax,
            "flops_per_token": b.fpt, "tokens_per_step": b.tokens_per_step, "compile_s": b.compile_s,
            "torch": torch.__version__}
    b.run(args.warmup)
    if args.serve:
        def run_steps(n: int) -> dict:
            before = matmul_peak()
            times = b.run(n)
            return {"times": times, "matmul_peak": [before, matmul_peak()], "loss": b.last_loss}
        serve(info, run_steps)
        return 0
    peaks = [matmul_peak()]
    s = stats(b.run(args.steps))
    peaks.append(matmul_peak())
    tps = b.tokens_per_step / s["median_s"]
    info.update(stats=s, tokens_per_sec=tps, matmul_peak_samples=peaks,
                fraction_of_matmul_peak=tps * b.fpt / max(peaks), final_loss=b.last_loss,
                host_peak_rss_bytes=peak_host_rss_bytes())
    print_table(f"torch {args.mode}: {args.config} {' '.join(args.overrides)}", [
        ("threads", str(torch.get_num_threads())),
        ("params", f"{b.n_params / 1e6:.3f}M (jaxtrain {n_jax / 1e6:.3f}M)"),
        ("first step (compile)", fmt(b.compile_s, " s", digits=2)),
        ("step time (median)", f"{s['median_s'] * 1e3:.1f} ms over {s['steps']} steps "
                               f"(p10 {s['p10_s'] * 1e3:.1f}, p90 {s['p90_s'] * 1e3:.1f}, spread {s['spread']:.1%})"),
        ("tokens/s", f"{tps:,.0f}"),
        ("matmul peak (torch)", " / ".join(fmt(x, "", 1e9) for x in peaks) + " GFLOP/s (before / after)"),
        ("fraction of peak", fmt(100 * info["fraction_of_matmul_peak"], "%")),
        ("host peak RSS", fmt(info["host_peak_rss_bytes"], " MiB", 2 ** 20)),
    ])
    write_json(args.json, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
