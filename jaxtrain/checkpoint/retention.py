"""Which committed checkpoints a run keeps (``checkpoint.keep``, ``keep_best``, ``keep_period``)."""
from __future__ import annotations


def keep_set(c, committed: dict[int, dict]) -> set[int]:
    """Steps the policy keeps: the last ``keep``, the best ``keep_best`` by ``best_metric``, and
    every multiple of ``keep_period``.

    Args:
      c: the ``checkpoint`` config section.
      committed: ``{step: commit marker}`` of the committed steps.
    """
    steps = sorted(committed)
    keep = set(steps[-c.keep:])
    if c.keep_period:
        keep |= {s for s in steps if s % c.keep_period == 0}
    if c.keep_best:
        scored = [(committed[s]["metrics"][c.best_metric], s) for s in steps
                  if isinstance(committed[s].get("metrics", {}).get(c.best_metric), (int, float))]
        scored.sort(reverse=c.best_mode == "max")
        keep |= {s for _, s in scored[:c.keep_best]}
    return keep
