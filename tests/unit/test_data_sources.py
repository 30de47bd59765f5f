"""Document sources, tokenizers (byte/char/HF BPE/SentencePiece) and bad-data handling."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from data_helpers import cfg_of, write_jsonl

from jaxtrain import config as cfglib
from jaxtrain import data as datalib
from jaxtrain.data import sources, store
from jaxtrain.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, special_ids
from jaxtrain.errors import DataError


@pytest.fixture(scope="session")
def bpe_path(tmp_path_factory, corpus_path):
    """A byte-level BPE (vocab 320) trained offline on tinyshakespeare with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([corpus_path], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_text_sources_one_doc_per_file_or_split(tmp_path):
    (tmp_path / "a.txt").write_text("first doc")
    (tmp_path / "b.txt").write_text("x||second||||third\n")
    one = sources.open_source(str(tmp_path / "*.txt"))
    assert [one[i] for i in range(len(one))] == [b"first doc", b"x||second||||third\n"]
    split = sources.open_source(str(tmp_path / "*.txt"), separator="||")
    assert [split[i] for i in range(len(split))] == [b"first doc", b"x", b"second", b"third\n"]


def test_jsonl_reads_by_offset_from_many_threads(tmp_path):
    docs = [{"text": f"document number {i} " * (i % 7 + 1), "id": i} for i in range(300)]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    src = sources.open_source(path)
    with ThreadPoolExecutor(8) as pool:  # Grain reads from a thread pool; a shared handle would mix lines
        got = list(pool.map(src.__getitem__, range(len(src)) ))
    assert got == [d["text"] for d in docs]


def test_jsonl_missing_field_and_bad_json_are_named(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"body": "no text here"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: no field 'text' \(data.text_field\); the record has: body"):
        datalib.load(cfg_of(f"data.path={path}"))
    (tmp_path / "e.jsonl").write_text('{"text": "ok"}\n\n{"text": broken\n')
    with pytest.raises(DataError, match=r"e\.jsonl:3: invalid JSON"):
        datalib.load(cfg_of(f"data.path={tmp_path / 'e.jsonl'}"))


def test_parquet_column_and_named_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": [f"row {i}" for i in range(50)]}), tmp_path / "p.parquet", row_group_size=16)
    src = sources.open_source(str(tmp_path / "p.parquet"), text_field="body")
    assert len(src) == 50 and src[0] == "row 0" and src[33] == "row 33" and src[49] == "row 49"
    with pytest.raises(DataError, match=r"p\.parquet: no column 'text' \(data.text_field\); columns: body"):
        sources.open_source(str(tmp_path / "p.parquet"))
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: row 1: column 'text' is null, not a string"):
        sources.open_source(str(tmp_path / "n.parquet"))[1]


def test_arrayrecord_source(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter
    w = ArrayRecordWriter(str(tmp_path / "docs.arrayrecord"), "group_size:1")
    for i in range(5):
        w.write(f"doc {i}".encode())
    w.close()
    src = sources.open_source(str(tmp_path / "docs.arrayrecord"))
    assert [src[i] for i in range(5)] == [f"doc {i}".encode() for i in range(5)]


def test_glob_matching_nothing_and_tiny_source_are_named(tmp_path):
    with pytest.raises(DataError, match=r"data.path: no file matches '.*nothing-\*\.jsonl'"):
        datalib.load(cfg_of(f"data.path={tmp_path}/nothing-*.jsonl"))
    path = write_jsonl(tmp_path / "small.jsonl", [{"text": "a few words"}] * 4)
    with pytest.raises(DataError, match=r"gives 2 training rows of data.seq_len=16 per epoch, fewer than one "
                                        r"batch \(train.global_batch=4\)"):
        datalib.load(cfg_of(f"data.path={path}"))


def test_a_path_that_is_not_a_regular_file_is_named(tmp_path):
    """A FIFO was reported as 'no file matches' its own path; reading one would block until a writer came."""
    fifo = tmp_path / "feed"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as err:
        datalib.load(cfg_of(f"data.path={fifo}"))
    assert str(err.value) == (f"data.path: '{fifo}' is not a regular file (a pipe, socket or device); give a file "
                              f"or a glob of files")


def test_empty_files_are_skipped_and_counted(tmp_path):
    for i in range(12):
        (tmp_path / f"{i:02d}.txt").write_text("" if i % 4 == 0 else f"text of document {i} " * 3)
    data = datalib.load(cfg_of(f"data.path={tmp_path}/*.txt", "data.tokenizer=char"))
    assert "skipped 3 empty/one-token documents" in data.info[0]
    assert "9 documents" in data.info[0]


def test_invalid_utf8_kept_by_byte_replaced_and_counted_by_others(tmp_path, bpe_path):
    bad = b"caf\xe9 au lait, " * 8  # latin-1 bytes: invalid UTF-8
    for i in range(10):
        (tmp_path / f"{i}.txt").write_bytes(bad if i == 3 else b"plain ascii text here " * 4)
    glob = f"data.path={tmp_path}/*.txt"
    byte = datalib.load(cfg_of(glob))
    assert "replaced invalid UTF-8 in 0" in byte.info[0]
    assert bytes(byte.schedule.parts[0][0].get(3).astype(np.uint8)) == bad  # raw bytes kept
    for tok in ("data.tokenizer=char", f"data.tokenizer_path={bpe_path}"):
        extra = ["data.tokenizer=hf"] if "path" in tok else []
        other = datalib.load(cfg_of(glob, tok, *extra))
        assert "replaced invalid UTF-8 in 1" in other.info[0]
        assert "\ufffd" in other.tokenizer.decode(other.schedule.parts[0][0].get(3))


def test_hf_bpe_trained_offline(bpe_path, corpus_path):
    from tokenizers import Tokenizer
    tok = HFTokenizer(bpe_path)
    text = open(corpus_path, encoding="utf-8").read()[:2000]
    ids = tok.encode(text)
    assert ids.tolist() == Tokenizer.from_file(bpe_path).encode(text).ids  # the library is the reference
    assert tok.decode(ids) == text and len(ids) < 0.7 * len(text) and tok.vocab_size == 320
    assert special_ids(tok, True, True) == (0, 1)  # <s>, </s>
    assert tok.to_json()["sha256"] and "source" in tok.to_json()


def test_tokenizer_that_needs_a_hub_is_refused():
    with pytest.raises(DataError, match="'gpt2' is not a local file; jaxtrain never downloads tokenizers"):
        HFTokenizer("gpt2")
    with pytest.raises(DataError, match="'meta-llama/Llama-2-7b' is not a local file"):
        datalib.load(cfg_of("data.path=stdlib", "data.tokenizer=sentencepiece",
                            "data.tokenizer_path=meta-llama/Llama-2-7b"))


def test_sentencepiece_trained_offline(tmp_path, corpus_path):
    import sentencepiece as spm
    sample = tmp_path / "sample.txt"
    sample.write_text(open(corpus_path, encoding="utf-8").read()[:100_000])
    spm.SentencePieceTrainer.train(input=str(sample), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", minloglevel=2)
    tok = SentencePieceTokenizer(str(tmp_path / "sp.model"))
    text = "Before we proceed any further, hear me speak."
    ids = tok.encode(text)
    assert ids.tolist() == spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model")).encode(text)
    assert tok.decode(ids) == text and tok.vocab_size == 200
    assert special_ids(tok, True, True) == (1, 2)  # SentencePiece's <s>, </s>


def test_bos_eos_wrap_every_document(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab" * 20}] * 40)
    data = datalib.load(cfg_of(f"data.path={path}", "data.add_bos=true", "data.add_eos=true"))
    assert data.tokenizer.vocab_size == 258
    doc = data.schedule.parts[0][0].get(0)
    assert doc[0] == 256 and doc[-1] == 257 and bytes(doc[1:-1].astype(np.uint8)) == b"ab" * 20
    with pytest.raises(DataError, match="data.eos_token: tokenizer 'byte' has no token '<end>'"):
        datalib.load(cfg_of(f"data.path={path}", "data.add_eos=true", "data.eos_token=<end>"))
    with pytest.raises(cfglib.ConfigError, match="data.add_bos: BOS/EOS are added per document"):
        cfg_of("data.mode=windows", "data.add_bos=true")


def test_weighted_mixture_takes_documents_in_proportion(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i} " * 4} for i in range(30)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"beta {i} " * 4} for i in range(30)])
    natural = datalib.load(cfg_of(f"data.mixture={{{a}: 1, {b}: 1}}", "data.val_fraction=0.1"))
    assert list(natural.schedule.counts) == [27, 27]
    data = datalib.load(cfg_of(f"data.mixture={{{a}: 3, {b}: 1}}", "data.val_fraction=0.1"))
    sched = data.schedule
    assert list(sched.counts) == [40, 14]  # 54 documents per epoch, split 3:1
    order = sched.layout(0).order
    assert (order < 27).sum() == 40 and (order >= 27).sum() == 14
    # source a (27 training docs) is cycled: its first 27 draws are a permutation, then a new one starts
    a_docs = [sched._source_docs(0, e) for e in range(2)]
    stream = np.concatenate(a_docs)
    assert sorted(stream[:27]) == list(range(27)) and sorted(stream[27:54]) == list(range(27))


def test_cache_equals_source_and_refuses_another_tokenizer(tmp_path, bpe_path):
    from jaxtrain.cli import prepare
    docs = [{"text": f"line {i}: " + "to be or not to be " * (i % 5 + 1)} for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    hf = ["data.tokenizer=hf", f"data.tokenizer_path={bpe_path}", "data.add_eos=true"]
    assert prepare.main([f"data.path={path}", *hf, "--out", str(tmp_path / "cache"), "--docs-per-shard", "16",
                         "--no-progress"]) == 0
    meta = json.loads((tmp_path / "cache" / store.CACHE_META).read_text())
    assert meta["documents"] == 40 and len(meta["shards"]) == 3 and meta["eos_id"] == 1
    direct = datalib.load(cfg_of(f"data.path={path}", *hf))
    cached = datalib.load(cfg_of(f"data.path={tmp_path / 'cache'}", *hf))
    for g in range(0, 3 * direct.schedule.rows_per_epoch(), 7):  # three epochs
        a, b = direct.schedule.row(g), cached.schedule.row(g)
        assert all((a[k] == b[k]).all() for k in a), g
    with pytest.raises(DataError, match=r"cache was tokenized with .*\"type\": \"hf\".* but this run uses "
                                        r"\{\"tokenizer\": \{\"type\": \"byte\", \"specials\": \[\"<eos>\"\]\}"):
        datalib.load(cfg_of(f"data.path={tmp_path / 'cache'}", "data.add_eos=true"))


def test_byte_tokenizer_keeps_specials_out_of_bytes():
    tok = ByteTokenizer(("<bos>", "<eos>"))
    assert tok.vocab_size == 258 and tok.special_id("<eos>") == 257 and tok.special_id("</s>") is None
    assert tok.decode([256, 104, 105, 257]) == "hi"


def test_document_options_are_checked_before_loading():
    with pytest.raises(cfglib.ConfigError, match="data.mixture: needs data.mode=packed or padded"):
        cfglib.load(None, ["data.mixture={a.jsonl: 1}"])
    with pytest.raises(cfglib.ConfigError, match="data.mixture: weight of 'a.jsonl' must be > 0, got 0"):
        cfg_of("data.mixture={a.jsonl: 0}")
    with pytest.raises(cfglib.ConfigError, match="data.tokenizer_path: data.tokenizer=hf needs a local tokenizer"):
        cfg_of("data.tokenizer=hf")
    for tok in ("byte", "char"):  # a path the tokenizer would not read
        with pytest.raises(cfglib.ConfigError) as err:
            cfg_of(f"data.tokenizer={tok}", "data.tokenizer_path=tokenizer.json")
        assert str(err.value) == (f"data.tokenizer_path: 'tokenizer.json' is not read by data.tokenizer={tok}; "
                                  f"set data.tokenizer=hf (tokenizer.json) or sentencepiece (.model), or leave the "
                                  f"path out")


def test_a_mixture_source_s_error_names_data_mixture_and_data_path_beside_it_is_noted(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i} " * 4} for i in range(30)])
    one = tmp_path / "one.txt"
    one.write_text("a single document " * 20)
    with pytest.raises(DataError) as err:
        datalib.load(cfg_of(f"data.mixture={{{a}: 3, {tmp_path}/zzz.txt: 1}}"))
    assert str(err.value) == f"data.mixture: no file matches '{tmp_path}/zzz.txt'"
    with pytest.raises(DataError) as err:
        datalib.load(cfg_of(f"data.mixture={{{a}: 3, {one}: 1}}", "data.val_fraction=0.1"))
    assert str(err.value) == (f"data.mixture: '{one}' has 1 usable document(s): too few to hold out a validation "
                              f"split (data.val_fraction=0.1; a text file is one document unless data.separator "
                              f"splits it)")
    data = datalib.load(cfg_of(f"data.mixture={{{a}: 1}}", f"data.path={one}"))
    assert data.info[-1] == f"[yellow]note:[/] data.mixture replaces data.path: '{one}' is not read"
    assert "note" not in " ".join(datalib.load(cfg_of(f"data.mixture={{{a}: 1}}")).info)
