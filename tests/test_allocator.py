"""PageAllocator: allocation, sharing, freeing, and its invariant check."""

import pytest

from jaxkv.cache.allocator import OutOfPagesError, PageAllocator


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
