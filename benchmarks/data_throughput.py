"""Loader throughput (tokens/s) cached vs uncached, next to the trainer's consumption; packing efficiency.

    python benchmarks/data_throughput.py [--corpus FILE] [--batches 200] [--steps 20]

Prints, on this machine:
1. the trainer's consumption on configs/shakespeare_char.yaml (tokens/s of train steps) and the
   windows loader that config uses;
2. the document loader on a JSONL corpus cut from the same text: uncached (read + tokenize at
   start-up, then batches) and cached (``jaxtrain.data.prepare`` once, then batches from ArrayRecord);
3. the packing efficiency (non-pad fraction) of packed and padded rows on documents of mixed lengths.
Loader figures are for one process building [grad_accum, micro, seq_len] batches on one CPU device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import config as cfglib
from jaxtrain import data as datalib
from jaxtrain.data import prepare
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.train import setup

SHARED = Path(os.environ.get("JAXTRAIN_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def sharding_for(cfg) -> NamedSharding:
    return NamedSharding(build_mesh(cfg.mesh, jax.devices()[:1]), P(None, ("data", "fsdp", "expert"), None))


def loader_rate(it, n: int, tokens_per_batch: int) -> float:
    next(it)  # warm-up (threads started, first epoch laid out)
    t0 = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(next(it))
    return n * tokens_per_batch / (time.perf_counter() - t0)


def trainer_rate(cfg, vocab: int, steps: int) -> float:
    trainer = setup(cfg, jax.devices()[:1], vocab=vocab).fns
    state = trainer.init()
    it = datalib.load(cfg).iterator(trainer.batch_sharding)
    batches = [next(it) for _ in range(steps + 2)]
    for b in batches[:2]:  # compile + warm-up
        state, m = trainer.train_step(state, b)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for b in batches[2:]:
        state, m = trainer.train_step(state, b)
    jax.block_until_ready(m)
    return steps * cfg.train.global_batch * cfg.data.seq_len / (time.perf_counter() - t0)


def mixed_corpus(text: str, path: Path, n: int, seed: int = 0) -> None:
    """JSONL documents cut from ``text`` with log-uniform lengths of 20..4000 characters."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            size = int(np.exp(rng.uniform(np.log(20), np.log(4000))))
            a = int(rng.integers(0, len(text) - size))
            f.write(json.dumps({"text": text[a:a + size]}) + "\n")


def train_bpe(corpus: str, out: Path) -> str:
    """A byte-level BPE with vocabulary 1024, trained offline on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([corpus], trainers.BpeTrainer(vocab_size=1024, special_tokens=["</s>"], show_progress=False,
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out))
    return str(out)


def document_loader(overrides: list[str], cache: Path, label: str, args) -> None:
    """Prints uncached (tokenize at start-up) and cached (prepare once) loader figures."""
    cfg = cfglib.load(None, overrides)
    per_batch = cfg.train.global_batch * cfg.data.seq_len
    t0 = time.perf_counter()
    uncached = datalib.load(cfg)
    startup = time.perf_counter() - t0
    rate_unc = loader_rate(uncached.iterator(sharding_for(cfg)), args.batches, per_batch)
    t0 = time.perf_counter()
    meta = prepare.prepare(cfg, str(cache), docs_per_shard=1000, progress=False)
    prep = time.perf_counter() - t0
    cached_cfg = cfglib.load(None, overrides + [f"data.path={cache}"])
    t0 = time.perf_counter()
    cached = datalib.load(cached_cfg)
    startup_c = time.perf_counter() - t0
    rate_c = loader_rate(cached.iterator(sharding_for(cached_cfg)), args.batches, per_batch)
    print(f"\ndocument loader, {args.docs} JSONL documents, {label} ({meta['tokens']:,} tokens), packed "
          f"{cfg.train.global_batch} x {cfg.data.seq_len}:")
    print(f"  uncached: start-up (read + tokenize) {startup:.2f} s = {meta['tokens'] / startup:,.0f} tokens/s; "
          f"then batches at {rate_unc:,.0f} tokens/s")
    print(f"  cached:   prepare once {prep:.2f} s ({meta['tokens'] / prep:,.0f} tokens/s); start-up "
          f"{startup_c:.2f} s; then batches at {rate_c:,.0f} tokens/s")
    print(f"  {cached.info[0]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", default=str(SHARED / "data" / "tinyshakespeare.txt"))
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--docs", type=int, default=3000)
    args = p.parse_args(argv)
    text = open(args.corpus, encoding="utf-8").read()
    tmp = Path(tempfile.mkdtemp(prefix="jaxtrain-bench-"))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; corpus {args.corpus}")

    shakes = cfglib.load("shakespeare_char", [f"data.path={args.corpus}", f"run.dir={tmp / 'run'}"])
    per_batch = shakes.train.global_batch * shakes.data.seq_len
    data = datalib.load(shakes)
    trainer = trainer_rate(shakes, data.tokenizer.vocab_size, args.steps)
    windows = loader_rate(data.iterator(sharding_for(shakes)), args.batches, per_batch)
    print(f"\nshakespeare_char (batch {shakes.train.global_batch} x {shakes.data.seq_len}, char, windows):")
    print(f"  trainer consumes        {trainer:>14,.0f} tokens/s")
    print(f"  windows loader supplies {windows:>14,.0f} tokens/s  ({windows / trainer:,.0f}x the trainer)")

    mixed_corpus(text, tmp / "docs.jsonl", args.docs)
    bpe = train_bpe(args.corpus, tmp / "bpe.json")
    common = [f"data.path={tmp / 'docs.jsonl'}", "data.mode=packed", "data.seq_len=256", "train.global_batch=32",
              "data.add_eos=true", "train.eval_batches=1"]
    for label, tok in (("byte", []), ("HF BPE 1024", ["data.tokenizer=hf", f"data.tokenizer_path={bpe}"])):
        document_loader(common + tok, tmp / f"cache-{len(tok)}", label, args)
    print("\npacking efficiency (non-pad fraction), documents of 20..4000 characters (log-uniform), byte tokens:")
    common = common[:1] + [f"data.path={tmp / 'cache-0'}"] + common[1:]
    for seq_len in (256, 1024, 4096):
        row = []
        for mode in ("packed", "padded"):
            cfg = cfglib.load(None, common + [f"data.path={tmp / 'cache-0'}", f"data.mode={mode}",
                                              f"data.seq_len={seq_len}", "train.global_batch=1"])
            sched = datalib.load(cfg).schedule
            row.append(f"{mode} {sched.layout(0).efficiency():6.1%}")
        print(f"  seq_len {seq_len:>5}: " + " | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
