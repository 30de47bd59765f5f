"""Packing/padding rows, epochs, document masks through the step, loss masks, resumable document batches."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import MeshConfig
from jaxtrain.data import packing, pipeline, store
from jaxtrain.errors import DataError
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.train import fit, setup


def doc_store(lengths, seed=0):
    """Documents whose tokens encode (document, index) so that rows can be traced back."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 250, size=n).astype(np.int32) for n in lengths]
    return store.MemoryStore(docs, store.new_stats()), docs


def test_packed_rows_hold_every_pair_once_with_masks_and_positions():
    lengths = [5, 40, 2, 17, 33, 9, 64, 3]
    st, docs = doc_store(lengths)
    lay = packing.Layout(np.arange(8), st.lengths - 1, seq_len=16, mode="packed")
    total = sum(n - 1 for n in lengths)
    assert lay.rows == -(-total // 16) and lay.efficiency() == pytest.approx(total / (16 * lay.rows))
    seen = {d: [] for d in range(8)}
    for r in range(lay.rows):
        segs = lay.segments(r)
        row = packing.assemble(segs, st.get, 16)
        pos = 0
        for k, (d, a, b) in enumerate(segs, start=1):
            sl = slice(pos, pos + b - a)
            np.testing.assert_array_equal(row["inputs"][sl], docs[d][a:b])
            np.testing.assert_array_equal(row["targets"][sl], docs[d][a + 1:b + 1])
            np.testing.assert_array_equal(row["positions"][sl], np.arange(b - a))
            assert (row["segment_ids"][sl] == k).all() and (row["loss_mask"][sl] == 1).all()
            seen[d].append((a, b))
            pos += b - a
        assert (row["loss_mask"][pos:] == 0).all() and (row["segment_ids"][pos:] == 0).all()
        assert pos == 16 or r == lay.rows - 1  # only the epoch's last row has padding
    for d, spans in seen.items():  # the pieces of each document tile its pairs exactly once
        assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]] and spans[-1][1] == lengths[d] - 1


def test_padded_rows_one_piece_each():
    st, docs = doc_store([5, 40, 17])
    lay = packing.Layout(np.arange(3), st.lengths - 1, seq_len=16, mode="padded")
    assert lay.rows == 1 + 3 + 1  # 4 pairs | 39 pairs = 16+16+7 | 16 pairs
    assert lay.efficiency() == pytest.approx((4 + 39 + 16) / (5 * 16))
    row = packing.assemble(lay.segments(3), st.get, 16)  # the last piece of document 1: pairs 32..38
    np.testing.assert_array_equal(row["inputs"][:7], docs[1][32:39])
    assert row["loss_mask"].tolist() == [1] * 7 + [0] * 9 and row["segment_ids"].max() == 1


def test_epochs_cover_every_document_once_and_reshuffle():
    st, docs = doc_store([7] * 23 + [12] * 10)  # 33 documents, 6 or 11 pairs each
    sched = pipeline.Schedule([(st, np.arange(33), None)], seq_len=8, mode="padded", seed=3)
    per_epoch = sched.rows_per_epoch()
    assert per_epoch == 23 + 10 * 2
    epochs = []
    for e in range(3):
        firsts = [tuple(sched.row(e * per_epoch + r)["inputs"][:3]) for r in range(per_epoch)]
        starts = [tuple(d[:3]) for d in docs]
        assert sorted(f for f in firsts if f in starts) == sorted(starts)  # each document exactly once
        epochs.append(sched.layout(e).order.tolist())
    assert epochs[0] != epochs[1] != epochs[2] and sorted(epochs[1]) == list(range(33))
    packed = pipeline.Schedule([(st, np.arange(33), None)], seq_len=8, mode="packed", seed=3)
    for e in range(2):  # packed: every (document, pair) of the epoch exactly once, 23*6 + 10*11 = 248 pairs
        lay = packed.layout(e)
        pairs = [(d, i) for r in range(lay.rows) for d, a, b in lay.segments(r) for i in range(a, b)]
        assert len(pairs) == len(set(pairs)) == 248 and lay.rows == 31
    assert packed.locate(31) == (1, 0) and packed.locate(62) == (2, 0)
    again = pipeline.Schedule([(st, np.arange(33), None)], 8, "padded", seed=3)
    assert again.layout(1).order.tolist() == epochs[1]  # a pure function of (seed, epoch)
    assert pipeline.Schedule([(st, np.arange(33), None)], 8, "padded", seed=4).layout(1).order.tolist() != epochs[1]


def small_trainer(small_cfg, *overrides):
    cfg = small_cfg("mesh.data=1", "data.mode=packed", "data.seq_len=16", *overrides)
    return setup(cfg, jax.devices()[:1], vocab=256).fns, cfg


def test_step_loss_is_per_document_loss_of_a_packed_row(small_cfg):
    """Packed rows through the step: masks and restarting positions make each document see only itself."""
    trainer, _ = small_trainer(small_cfg, "train.global_batch=2")
    params = trainer.init()["params"]
    st, docs = doc_store([6, 9, 5, 14, 4, 7], seed=1)
    lay = packing.Layout(np.arange(6), st.lengths - 1, 16, "packed")
    rows = packing.stack([packing.assemble(lay.segments(r), st.get, 16) for r in range(2)])
    got = float(trainer.eval_step(params, rows)["loss"])
    # Reference: every document piece alone through the plain model, positions 0.., no mask.
    ce, n = 0.0, 0
    for r in range(2):
        for d, a, b in lay.segments(r):
            alone = np.zeros((1, 16), np.int32)  # one shape (one compile); causal: the tail is not seen
            alone[0, :b - a] = docs[d][a:b]
            logits = np.asarray(trainer.apply(params, alone), np.float64)[0, :b - a]
            logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
                - logits.max(-1, keepdims=True)
            ce -= logp[np.arange(b - a), docs[d][a + 1:b + 1]].sum()
            n += b - a
    assert got == pytest.approx(ce / n, rel=1e-5)


def test_packed_row_logits_ignore_other_documents():
    """A token's logits do not change when another document of the same packed row changes."""
    from flax import nnx

    from jaxtrain.models.llama import Llama, LlamaConfig
    model = Llama(LlamaConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                              init_std=0.3), nnx.Rngs(0))
    lengths = [4, 7, 3, 14]
    st, docs = doc_store(lengths, seed=1)
    docs2 = [d.copy() for d in docs]
    docs2[1][2:] = (docs2[1][2:] + 11) % 256  # document 1 (segment 2 of row 0) changes
    st2 = store.MemoryStore(docs2, store.new_stats())
    lay = packing.Layout(np.arange(4), st.lengths - 1, 16, "packed")
    rows = [packing.assemble(lay.segments(0), s.get, 16) for s in (st, st2)]
    seg = rows[0]["segment_ids"]
    assert sorted(set(seg.tolist())) == [1, 2, 3, 4]  # four documents share the row
    la, lb = (np.asarray(model(r["inputs"][None], r["positions"][None], r["segment_ids"][None]))[0] for r in rows)
    np.testing.assert_array_equal(la[seg != 2], lb[seg != 2])
    assert not np.allclose(la[seg == 2][3:], lb[seg == 2][3:])  # control: the changed document does change
    plain = np.asarray(model(rows[1]["inputs"][None]))[0]  # without segment_ids the change leaks forward
    assert not np.allclose(plain[seg == 3], la[seg == 3])


def test_grad_accumulation_with_uneven_loss_masks_matches_full_batch(small_cfg):
    st, _ = doc_store([3, 20, 9, 30, 2, 14, 5, 11, 26, 8, 4, 17], seed=2)
    lay = packing.Layout(np.arange(12), st.lengths - 1, 16, "padded")
    rows = packing.stack([packing.assemble(lay.segments(r), st.get, 16) for r in range(12)])
    assert len(set(rows["loss_mask"].sum(1).tolist())) > 3  # micro-batches with different token counts
    outs = []
    for accum in (1, 4):
        trainer, _ = small_trainer(small_cfg, "train.global_batch=12", f"train.grad_accum={accum}", "data.mode=padded")
        batch = jax.device_put({k: v.reshape(accum, 12 // accum, 16) for k, v in rows.items()},
                               trainer.batch_sharding)
        params = trainer.init()["params"]
        outs.append((trainer.grads(params, batch), trainer.train_step(trainer.init(), batch)[1]))
    ((l1, _, g1), m1), ((l4, _, g4), m4) = outs
    assert float(l1) == float(m1["loss"]) and float(l4) == float(m4["loss"])
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), rel=1e-6)
    assert float(m1["grad_norm"]) == pytest.approx(float(m4["grad_norm"]), rel=1e-5)
    # The gradients themselves (not params after an Adam step, whose g/(|g|+eps) turns the summation
    # order's rounding in a near-zero gradient into a difference of order lr).
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree_util.tree_leaves(g1))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g4)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6 * scale)
    # Control: averaging the 4 micro-batch means (ignoring their token counts) gives another loss.
    params = trainer.init()["params"]  # the grad_accum=4 trainer
    micro = [float(trainer.eval_step(params, {k: v[3 * i:3 * i + 3] for k, v in rows.items()})["loss"])
             for i in range(4)]
    assert abs(np.mean(micro) - float(m1["loss"])) > 1e-4  # 20x the tolerance above


def test_document_iterator_resumes_and_refuses_another_layout():
    st, _ = doc_store(np.random.default_rng(5).integers(2, 60, size=80))
    sched = pipeline.Schedule([(st, np.arange(80), None)], 16, "packed", seed=0)
    sharding = NamedSharding(build_mesh(MeshConfig(data=8)), P(None, ("data", "fsdp", "expert"), None))
    it = pipeline.DocBatchIterator(sched, global_batch=16, grad_accum=2, sharding=sharding)
    batches = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(4)]
    assert it.get_state() == {"next_row": 64, "mode": "packed", "seq_len": 16, "seed": 0}
    it2 = pipeline.DocBatchIterator(sched, 16, 2, sharding)
    it2.set_state({"next_row": 32, "mode": "packed", "seq_len": 16, "seed": 0})
    for want in batches[2:]:
        got = next(it2)
        assert got["inputs"].shape == (2, 8, 16) and got["inputs"].sharding == sharding
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k])
    # The batch is rows next_row.. in order: micro-batch a holds rows a*8 .. a*8+7.
    np.testing.assert_array_equal(batches[1]["inputs"][1, 3], sched.row(16 + 8 + 3)["inputs"])
    with pytest.raises(DataError, match="data position: saved with .*'seq_len': 32.* so the rows would differ"):
        it2.set_state({"next_row": 32, "mode": "packed", "seq_len": 32, "seed": 0})


def test_packed_training_resumes_exactly(small_cfg, tmp_path):
    docs = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    text = open(small_cfg().data.path, encoding="utf-8").read()
    with open(docs, "w") as f:
        for i in range(300):
            a = int(rng.integers(0, len(text) - 400))
            f.write('{"text": %s}\n' % __import__("json").dumps(text[a:a + int(rng.integers(5, 300))]))
    common = ("data.mode=packed", f"data.path={docs}", "data.add_eos=true", "train.grad_accum=2",
              "checkpoint.every=3", "checkpoint.async_save=false", "train.steps=6", "mesh.data=1")
    one = jax.devices()[:1]
    full = fit(small_cfg(*common, run_dir="full"), devices=one, quiet=True)
    # Resume from step 3 of a copy of the same run (its step-6 checkpoint removed).
    import shutil
    shutil.copytree(full.run_dir, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")
    second = fit(small_cfg(*common, run_dir="resumed"), devices=one, quiet=True)
    assert second.start_step == 3
    assert [second.losses[s] for s in (4, 5, 6)] == [full.losses[s] for s in (4, 5, 6)]
    assert full.losses[6] < full.losses[1] and np.isfinite(full.val_loss)
