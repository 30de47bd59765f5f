"""Small configs and files for the data-source tests of both tiers."""
import json

from jaxtrain import config as cfglib


def cfg_of(*overrides):
    """A packed-mode config with short rows and one evaluation batch, plus ``overrides``."""
    return cfglib.load(None, ["data.mode=packed", "data.seq_len=16", "train.global_batch=4",
                              "train.eval_batches=1", *overrides])


def write_jsonl(path, docs):
    """Writes ``docs`` (dicts) to ``path`` one JSON object per line; returns the path as a string."""
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)
