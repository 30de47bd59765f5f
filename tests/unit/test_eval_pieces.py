"""How an evaluation is cut into pieces (jaxtrain.train.evaluation.eval_piece): equal pieces, a
multiple of the side-by-side group, at most 32 of them, as many as that allows."""
import pytest

from jaxtrain.train.evaluation import EVAL_PIECES, eval_piece


@pytest.mark.parametrize("n_batches, group, piece", [
    (40, 5, 5),  # the shakespeare config on one device: 8 groups of 5, each its own piece
    (36, 1, 2),  # 18 pieces: no divisor of 36 gives 32 to 36 pieces
    (400, 1, 16),  # 25 pieces
    (2000, 1, 80),  # 25: 2000 has no divisor between 63 and 79
    (7, 1, 1),  # small sets: a piece per batch
    (37, 1, 37),  # a prime above the limit: one piece
    (6, 6, 6),  # one group: one piece
    (64, 2, 2),  # exactly 32 pieces
])
def test_pieces(n_batches, group, piece):
    assert eval_piece(n_batches, group) == piece
    assert n_batches % piece == 0 and piece % group == 0
    assert n_batches // piece <= EVAL_PIECES or piece == n_batches
