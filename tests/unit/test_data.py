"""Corpus split, tokenizers, deterministic windows, resumable iterator, batch layout on the mesh."""
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import MeshConfig
from jaxtrain.data import arrays, packing, windows
from jaxtrain.data.tokenizers import ByteTokenizer, CharTokenizer
from jaxtrain.errors import DataError
from jaxtrain.parallel.mesh import build_mesh


def test_char_split_is_last_tenth(small_cfg, corpus_path):
    cfg = small_cfg("data.tokenizer=char")
    corpus = windows.load_corpus(cfg)
    text = open(corpus_path, encoding="utf-8").read()
    split = int(len(text) * 0.9)
    assert corpus.tokenizer.decode(corpus.train) == text[:split]
    assert corpus.tokenizer.decode(corpus.val) == text[split:]
    assert corpus.tokenizer.vocab_size == 66  # 65 distinct characters of tinyshakespeare + <unk>


def test_tokenizers_round_trip():
    byte = ByteTokenizer()
    s = "naïve → code"
    assert byte.decode(byte.encode(s)) == s and byte.encode(s).dtype == np.int32
    char = CharTokenizer.build("abc")
    assert list(char.encode("cab?")) == [2, 0, 1, 3]  # unseen '?' -> <unk> = 3
    assert CharTokenizer(char.to_json()["chars"]).encode("ba").tolist() == [1, 0]
    # unseen characters (also above the vocabulary's code points, and astral ones) are <unk>
    assert char.encode("c\u00e9ab\U0001F600z").tolist() == [2, 3, 0, 1, 3, 3] and char.encode("").tolist() == []
    assert CharTokenizer.build("z\U0001F600").encode(b"\xf0\x9f\x98\x80z").tolist() == [1, 0]


def test_saved_tokenizer_mismatch_is_named_error(small_cfg):
    cfg = small_cfg("data.tokenizer=char")
    with pytest.raises(DataError, match="differs from the one saved in the run directory"):
        windows.load_corpus(cfg, saved=CharTokenizer(list("xyz")))


def test_windows_are_contiguous_and_deterministic():
    tokens = np.arange(1000, dtype=np.int32)
    ds = windows.train_dataset(tokens, seq_len=16, global_batch=4, seed=7)
    b0 = np.asarray(ds[0])
    assert b0.shape == (4, 17)
    assert (np.diff(b0, axis=1) == 1).all()  # each row is tokens[i:i+17]
    again = windows.train_dataset(tokens, 16, 4, seed=7)
    other = windows.train_dataset(tokens, 16, 4, seed=8)
    assert all((np.asarray(ds[i]) == np.asarray(again[i])).all() for i in range(5))
    assert not all((np.asarray(ds[i]) == np.asarray(other[i])).all() for i in range(5))


def test_batched_gather_gives_the_stream_and_state_of_a_window_per_element():
    """The training stream as it was made before (one window per element, batched afterwards) must not
    change: a saved data position resumes the same batches. 61 windows in batches of 4: 40 batches
    cross three epoch boundaries, one of them inside a batch."""
    import grain
    tokens = np.arange(100, 200, dtype=np.int32)
    per_element = (grain.MapDataset.range(61).shuffle(seed=3).repeat()
                   .map(lambda i: tokens[i:i + 40]).batch(4, drop_remainder=True))
    ds = windows.train_dataset(tokens, seq_len=39, global_batch=4, seed=3)
    for i in range(40):
        got, want = np.asarray(ds[i]), np.asarray(per_element[i])
        assert got.dtype == want.dtype == np.int32 and np.array_equal(got, want), i
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    a, b = iter(ds.to_iter_dataset(read)), iter(per_element.to_iter_dataset(read))
    for _ in range(17):
        next(a), next(b)
    assert a.get_state() == b.get_state() == {"next_index": 17}


def test_one_epoch_covers_every_window_once():
    tokens = np.arange(40, dtype=np.int32)
    ds = windows.train_dataset(tokens, seq_len=7, global_batch=1, seed=0)  # 33 windows
    starts = [int(np.asarray(ds[i])[0, 0]) for i in range(33)]
    assert sorted(starts) == list(range(33))


def test_iterator_resumes_at_the_same_batch():
    mesh = build_mesh(MeshConfig(data=8))
    sharding = NamedSharding(mesh, P(None, ("data", "fsdp", "expert"), None))
    tokens = np.arange(5000, dtype=np.int32)
    ds = windows.train_dataset(tokens, 8, 16, seed=1).map(packing.from_windows)
    it = arrays.BatchIterator(ds, grad_accum=2, sharding=sharding)
    for _ in range(3):
        next(it)
    state = it.get_state()
    want = {k: np.asarray(v) for k, v in next(it).items()}
    it2 = arrays.BatchIterator(ds, grad_accum=2, sharding=sharding)
    it2.set_state(state)
    got = next(it2)
    assert set(got) == {"inputs", "targets", "loss_mask"}  # one segment at positions 0..T-1: implicit
    for k, v in got.items():
        assert v.shape == (2, 8, 8) and v.sharding.spec == P(None, ("data", "fsdp", "expert"), None), k
        np.testing.assert_array_equal(np.asarray(v), want[k])
    np.testing.assert_array_equal(want["targets"][..., :-1], want["inputs"][..., 1:])  # windows: shifted by one
    assert (want["loss_mask"] == 1).all()


def test_val_batches_are_windows_of_val_tokens():
    tokens = np.arange(300, dtype=np.int32)
    v = windows.val_batches(tokens, seq_len=10, batch=3, n_batches=4, seed=0)
    assert v.shape == (4, 3, 11) and (np.diff(v, axis=-1) == 1).all() and v.max() < 300


def test_directory_path_is_named_error(tmp_path):
    with pytest.raises(DataError, match="is a directory; give a file or a glob"):
        windows.corpus_files(str(tmp_path))


def test_stdlib_corpus_is_sorted_python_files():
    files = windows.corpus_files("stdlib")
    assert files == sorted(files) and len(files) > 50 and all(f.suffix == ".py" for f in files)
