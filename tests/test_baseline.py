"""The article's SimpleMemoryPool behaves as the article describes, flaws included."""

from __future__ import annotations

import pytest

from gpupool._baseline import SimpleMemoryPool


def test_reuses_a_freed_piece_of_the_same_size():
    pool = SimpleMemoryPool(4096)
    first = pool.alloc(1000)
    pool.alloc(1000)
    pool.free(first)
    assert pool.alloc(1000) == first


def test_never_coalesces_neighbours():
    pool = SimpleMemoryPool(1024)
    pieces = [pool.alloc(512), pool.alloc(512)]
    for offset in pieces:
        pool.free(offset)
    with pytest.raises(MemoryError):
        pool.alloc(1024)


def test_rejects_unknown_offsets():
    pool = SimpleMemoryPool(1024)
    offset = pool.alloc(10)
    pool.free(offset)
    with pytest.raises(ValueError):
        pool.free(offset)
