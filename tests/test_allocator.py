"""PageAllocator: allocation, sharing, freeing, and its invariant check."""

import pytest

from jaxkv.cache.allocator import OutOfPagesError, PageAllocator

pytestmark = pytest.mark.host  # no engine: `make test-fast`


def test_allocate_share_free_cycle():
    a = PageAllocator(6)
    x = a.allocate(4)
    assert len(set(x)) == 4 and a.num_free == 2
    a.share(x[:2])
    assert a.refcount(x[0]) == 2
    a.free(x)
    assert a.num_free == 4 and a.refcount(x[0]) == 1
    a.free(x[:2])
    assert a.num_free == 6
    a.check()


def test_exhaustion_and_double_free():
    a = PageAllocator(3)
    pages = a.allocate(3)
    with pytest.raises(OutOfPagesError, match="need 1 pages, 0 of 3 free"):
        a.allocate(1)
    a.free(pages)
    with pytest.raises(ValueError, match="double free"):
        a.free(pages[:1])
    with pytest.raises(ValueError, match="is free"):
        a.share(pages[:1])
    a.check()


def test_check_catches_corruption():
    a = PageAllocator(3)
    a.allocate(1)
    a._refs[2] = 1  # a page both free and referenced
    with pytest.raises(AssertionError, match="page 2"):
        a.check()


def test_share_and_free_are_all_or_nothing():
    a = PageAllocator(4)
    x = a.allocate(2)
    with pytest.raises(ValueError, match="page 3 is free"):
        a.share([x[0], 3])
    assert a.refcount(x[0]) == 1
    with pytest.raises(ValueError, match="double free"):
        a.free([x[0], x[1], x[1]])
    assert a.refcount(x[0]) == 1 and a.refcount(x[1]) == 1
    a.share([x[1]])
    a.free([x[1], x[1]])  # two holders, two drops in one call
    assert a.refcount(x[1]) == 0 and a.num_free == 3
    a.check(holders=[[x[0]]])


def test_copy_on_write_sole_holder_keeps_page():
    a = PageAllocator(3)
    (p,) = a.allocate(1)
    assert a.copy_on_write(p) == (p, False)
    assert a.refcount(p) == 1 and a.num_free == 2
    a.check(holders=[[p]])


def test_copy_on_write_shared_page_moves_callers_ref():
    a = PageAllocator(3)
    (p,) = a.allocate(1)
    a.share([p])  # holders: cache and request
    new, copied = a.copy_on_write(p)
    assert copied and new != p
    assert a.refcount(p) == 1 and a.refcount(new) == 1 and a.num_free == 1
    a.check(holders=[[p], [new]])


def test_copy_on_write_out_of_pages_changes_nothing():
    a = PageAllocator(2)
    pages = a.allocate(2)
    a.share(pages[:1])
    with pytest.raises(OutOfPagesError):
        a.copy_on_write(pages[0])
    assert a.refcount(pages[0]) == 2
    a.check(holders=[pages, pages[:1]])
    a.free(pages)
    with pytest.raises(ValueError, match="is free"):
        a.copy_on_write(pages[1])


def test_check_holders_catches_leaks_and_duplicates():
    a = PageAllocator(4)
    x = a.allocate(2)
    a.share(x[:1])
    a.check(holders=[x, x[:1]])
    with pytest.raises(AssertionError, match=f"page {x[0]}: refcount 2, but 1 holders"):
        a.check(holders=[x])  # a leaked reference
    with pytest.raises(AssertionError, match=f"page {x[1]}: refcount 1, but 2 holders"):
        a.check(holders=[x, x])  # a reference nobody took
    with pytest.raises(AssertionError, match="lists a page twice"):
        a.check(holders=[[x[0], x[0]], x[1:]])
    with pytest.raises(AssertionError, match="out of range"):
        a.check(holders=[x, x[:1], [9]])


def test_drain_freed_reports_pages_that_are_still_free():
    a = PageAllocator(4, track_freed=True)
    x = a.allocate(3)
    a.free(x[:2])
    again = a.allocate(3)  # takes the last never-used page, then the two freed ones
    assert set(x[:2]) <= set(again)
    a.free([x[2]])
    assert a.drain_freed() == [x[2]]  # x[0], x[1] were freed but are in use again
    assert a.drain_freed() == []
    with pytest.raises(ValueError, match="track_freed"):
        PageAllocator(2).drain_freed()
