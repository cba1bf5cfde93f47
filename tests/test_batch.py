"""Batch building: buckets, padding, and validation of every index a step will write."""

import numpy as np
import pytest

from jaxkv.runtime.batch import PageTable, Row, bucket, build_batch, fit, ladder

pytestmark = pytest.mark.host  # no engine: `make test-fast`


def test_bucket_values():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 7, 13, 100, 1000)] == \
        [1, 2, 3, 4, 6, 8, 16, 128, 1024]
    assert bucket(3, minimum=8) == 8
    # Bounded padding: never more than 1.5x the request beyond the minimum.
    assert all(n <= bucket(n) < 1.5 * n + 1 for n in range(1, 3000))


def test_ladder_and_fit():
    assert ladder(512) == (16, 32, 64, 128, 256, 512)
    assert ladder(300) == (16, 32, 64, 128, 256, 512)  # the first power of two >= 300
    assert ladder(4) == (16,) and ladder(20, 8) == (8, 16, 32)
    assert [fit(n, ladder(64)) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    with pytest.raises(ValueError, match="exceeds"):
        fit(65, ladder(64))


def _table(max_seqs=4, width=4, num_pages=5, page_size=2):
    return PageTable(max_seqs, width, num_pages, page_size)


def test_build_batch_layout():
    """Row b is slot b: an idle slot has no tokens and length 0, tokens go in slot order."""
    rows = [Row(slot=2, tokens=[5, 6, 7], start=0, pages=[4, 1]),
            Row(slot=0, tokens=[9], start=5, pages=[3, 0, 2])]
    table = _table()
    b = build_batch(rows, table, tokens_bucket=16, vocab_size=10)
    assert b.tokens.shape == (16,) and b.kv_lens.shape == (4,) and b.page_table.shape == (4, 4)
    np.testing.assert_array_equal(b.tokens[:4], [9, 5, 6, 7])
    np.testing.assert_array_equal(b.positions[:4], [5, 0, 1, 2])
    np.testing.assert_array_equal(b.write_pages[:4], [2, 4, 4, 1])
    np.testing.assert_array_equal(b.write_offsets[:4], [1, 0, 1, 0])
    assert (b.write_pages[4:] == 5).all()  # padding writes are dropped (page index == P)
    np.testing.assert_array_equal(b.cu_q_lens, [0, 1, 1, 4, 4])
    np.testing.assert_array_equal(b.kv_lens, [6, 0, 3, 0])
    np.testing.assert_array_equal(b.page_table[[0, 2], :3], [[3, 0, 2], [4, 1, 0]])
    assert int(b.num_seqs) == 4


def test_page_table_rewrites_only_what_changed():
    table = _table(max_seqs=2, width=6, num_pages=50, page_size=4)
    owner = object()
    table.update(0, [7, 8, 9], start=0, owner=owner)
    np.testing.assert_array_equal(table.table[0, :3], [7, 8, 9])
    table.table[0, 0] = 42  # a page before the write position: the same owner never changes it
    table.update(0, [7, 8, 10, 11], start=9, owner=owner)  # copy-on-write of page 2, one more
    np.testing.assert_array_equal(table.table[0, :4], [42, 8, 10, 11])
    table.update(0, [1, 2], start=0, owner=object())  # a new owner rewrites its pages
    np.testing.assert_array_equal(table.table[0, :2], [1, 2])
    with pytest.raises(ValueError, match="page id"):
        table.update(1, [50], start=0, owner=None)
    with pytest.raises(ValueError, match="7 pages"):
        table.update(1, list(range(7)), start=0, owner=None)


@pytest.mark.parametrize("row, match", [
    (Row(slot=9, tokens=[1], start=0, pages=[0]), "slot 9"),
    (Row(slot=0, tokens=[1, 2, 3], start=0, pages=[0]), "needs 2 pages"),
    (Row(slot=0, tokens=[1], start=0, pages=[7]), "page id"),
    (Row(slot=0, tokens=[12], start=0, pages=[0]), "token id 12"),
    (Row(slot=0, tokens=[], start=0, pages=[0]), "no tokens"),
    (Row(slot=0, tokens=list(range(17)), start=0, pages=[0, 1, 2, 3, 0, 1, 2, 3, 0]), "bucket"),
])
def test_build_batch_rejects(row, match):
    with pytest.raises(ValueError, match=match):
        build_batch([row], PageTable(2, 9, 4, 2), tokens_bucket=16, vocab_size=20 if
                    match == "bucket" else 10)
