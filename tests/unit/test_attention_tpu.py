"""The TPU (Mosaic) variant of our flash attention, in Pallas' TPU interpret mode.

TPU interpret mode is ~100x slower than jnp, so these cases are tiny (blocks of 8) but still
span several blocks and cover causal + GQA + segment ids, non-causal, q_len != kv_len with a
window, and a length that is not a block multiple.
"""
import jax.numpy as jnp
import pytest
from attention_helpers import assert_matches_reference, inputs

from jaxtrain.kernels.pallas import flash_tpu


def flash(q, k, v, qseg=None, kvseg=None, **kw):
    return flash_tpu.flash_attention(q, k, v, qseg, kvseg, block_q=8, block_k=8, **kw)


@pytest.mark.parametrize("causal,h,kvh,tq,tk,window,packed", [
    (True, 4, 2, 20, 20, None, True),
    (False, 2, 1, 12, 20, 5, False),
])
def test_tpu_variant_matches_reference(causal, h, kvh, tq, tk, window, packed):
    q, k, v, do = inputs(1, tq, tk, h, kvh, 32)
    seg = jnp.asarray([[0] * 7 + [1] * (tq - 7)], jnp.int32) if packed else None
    assert_matches_reference(flash, q, k, v, do, seg, seg, causal=causal, window=window)
