"""The seed article's toy pool, kept as the baseline gpupool's benchmarks must beat."""

from __future__ import annotations


class SimpleMemoryPool:
    """Hands out offsets in a fixed arena: first fit over free sizes, no coalescing.

    Free pieces are kept in a dict from size to a list of offsets and are never merged, which is
    what makes it fast on repeated equal sizes and fragment badly on anything else.
    """

    def __init__(self, total_size: int = 1 << 30) -> None:
        self.total_size = total_size
        self.free_blocks: dict[int, list[int]] = {total_size: [0]}
        self.allocated: dict[int, int] = {}

    def alloc(self, size: int) -> int:
        """Returns the offset of ``size`` bytes; raises MemoryError when no free piece fits."""
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        for free_size in sorted(self.free_blocks):
            if free_size < size:
                continue
            offsets = self.free_blocks[free_size]
            offset = offsets.pop(0)
            if not offsets:
                del self.free_blocks[free_size]
            if free_size > size:
                self.free_blocks.setdefault(free_size - size, []).append(offset + size)
            self.allocated[offset] = size
            return offset
        raise MemoryError(f"no free piece of {size} bytes in a {self.total_size}-byte arena")

    def free(self, offset: int) -> None:
        """Returns the piece at ``offset`` to the free lists as it is, without merging."""
        try:
            size = self.allocated.pop(offset)
        except KeyError:
            raise ValueError(f"offset {offset} is not allocated") from None
        self.free_blocks.setdefault(size, []).append(offset)
