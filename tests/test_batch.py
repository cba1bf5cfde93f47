"""Batch building: buckets, padding, and validation of every index a step will write."""

import numpy as np
import pytest

from jaxkv.runtime.batch import Row, bucket, build_batch


def test_bucket_values():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 7, 13, 100, 1000)] == \
        [1, 2, 3, 4, 6, 8, 16, 128, 1024]
    assert bucket(3, minimum=8) == 8
    # Bounded padding: never more than 1.5x the request beyond the minimum.
    assert all(n <= bucket(n) < 1.5 * n + 1 for n in range(1, 3000))


def test_build_batch_layout():
    rows = [Row(slot=2, tokens=[5, 6, 7], start=0, pages=[4, 1]),
            Row(slot=0, tokens=[9], start=5, pages=[3, 0, 2])]
    b = build_batch(rows, page_size=2, num_pages=5, max_seqs=4, max_pages_per_seq=4,
                    vocab_size=10, min_tokens=8)
    assert b.tokens.shape == (8,) and b.slots.shape == (2,)
    np.testing.assert_array_equal(b.tokens[:4], [5, 6, 7, 9])
    np.testing.assert_array_equal(b.positions[:4], [0, 1, 2, 5])
    np.testing.assert_array_equal(b.write_pages[:4], [4, 4, 1, 2])
    np.testing.assert_array_equal(b.write_offsets[:4], [0, 1, 0, 1])
    assert (b.write_pages[4:] == 5).all()  # padding writes are dropped (page index == P)
    np.testing.assert_array_equal(b.cu_q_lens, [0, 3, 4])
    np.testing.assert_array_equal(b.kv_lens, [3, 6])
    np.testing.assert_array_equal(b.page_table, [[4, 1, 0], [3, 0, 2]])  # width bucket(3)
    assert int(b.num_seqs) == 2 and b.max_q_len == 4  # the longest row, 3, as a power of 2


@pytest.mark.parametrize("row, match", [
    (Row(slot=9, tokens=[1], start=0, pages=[0]), "slot 9"),
    (Row(slot=0, tokens=[1, 2, 3], start=0, pages=[0]), "needs 2 pages"),
    (Row(slot=0, tokens=[1], start=0, pages=[7]), "page id"),
    (Row(slot=0, tokens=[12], start=0, pages=[0]), "token id 12"),
    (Row(slot=0, tokens=[], start=0, pages=[0]), "no tokens"),
])
def test_build_batch_rejects(row, match):
    with pytest.raises(ValueError, match=match):
        build_batch([row], page_size=2, num_pages=4, max_seqs=2, max_pages_per_seq=3,
                    vocab_size=10)


def test_unbucketed_pads_tokens_to_16_only():
    rows = [Row(slot=0, tokens=list(range(1, 20)), start=0, pages=[0, 1, 2])]
    b = build_batch(rows, page_size=8, num_pages=3, max_seqs=1, max_pages_per_seq=3,
                    bucketed=False)
    assert b.tokens.shape == (32,) and b.page_table.shape == (1, 3) and b.max_q_len == 32
    assert build_batch(rows, page_size=8, num_pages=3, max_seqs=1,
                       max_pages_per_seq=3).tokens.shape == (24,)  # bucket(19)
