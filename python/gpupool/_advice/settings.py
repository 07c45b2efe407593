"""The allocator settings a snapshot recorded, as a ``PYTORCH_ALLOC_CONF`` value and as the gpupool
configuration that replays it."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool import _native

MiB = 1 << 20
# ``max_split_size`` is SIZE_MAX (-1 as PyTorch's int64) when unset.
_UNLIMITED = (-1, (1 << 64) - 1, (1 << 63) - 1)
# The recorded string, under the name each PyTorch version wrote it.
_STRING_KEYS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "last_allocator_settings")
# Recorded fields that repeat a key of the string, and fields that are no config key at all.
_FIELDS = {
    "max_split_size",
    "garbage_collection_threshold",
    "expandable_segments",
    "roundup_power2_divisions",
    "release_lock_on_cudamalloc",
    "pinned_num_register_threads",
    "pinned_use_cuda_host_register",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
}


@dataclass
class Settings:
    """What the user ran: ``env`` is the ``PYTORCH_ALLOC_CONF`` value (empty: PyTorch's defaults)."""

    env: str
    recorded: bool
    # Keys given that gpupool accepts without simulating them (they do not affect device memory).
    inert: list[str] = field(default_factory=list)
    # Recorded fields and keys gpupool does not know or cannot take (a newer PyTorch's), with why.
    unknown: list[str] = field(default_factory=list)

    @property
    def expandable(self) -> bool:
        return "expandable_segments:True" in self.env.split(",")


def _items(text: str) -> dict[str, str]:
    """``key:value`` items of a config string, brackets kept whole, later keys winning."""
    items, depth, start = {}, 0, 0
    compact = "".join(text.split())
    for index, char in enumerate(compact + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            item = compact[start:index]
            start = index + 1
            if ":" in item:
                key, value = item.split(":", 1)
                items[key] = value
    return items


def _divisions(table: Any) -> str | None:
    """``roundup_power2_divisions`` as recorded ({interval start in MiB: divisions}) in list form;
    a ValueError names the first entry that is not a start and a count."""
    if not isinstance(table, Mapping):
        return None
    pairs = []
    for start, count in table.items():
        # isascii: '²'.isdigit() is True, but int() refuses it.
        readable = str(start).isascii() and str(start).isdigit()
        if not readable or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"cannot read {reprlib.repr(start)}: {reprlib.repr(count)}")
        pairs.append((int(start), count))
    if not any(count > 1 for _, count in pairs):
        return None
    return "[" + ",".join(f"{start}:{count}" for start, count in sorted(pairs)) + "]"


def from_recorded(recorded: Mapping[str, Any] | None, expandable_shown: bool = False) -> Settings:
    """The settings of ``allocator_settings``. When the snapshot has none (older PyTorch wrote
    none, with expandable segments too), PyTorch's defaults, with expandable segments where
    ``expandable_shown``: the segments or their events show them. What cannot be read or taken
    is named in ``unknown`` and left out, never fatal."""
    if recorded is None:
        return Settings("expandable_segments:True" if expandable_shown else "", recorded=False)
    text = next((v for k in _STRING_KEYS if isinstance(v := recorded.get(k), str)), "")
    items = _items(text)
    split = recorded.get("max_split_size")
    if isinstance(split, int) and split not in _UNLIMITED and split > 0:
        items["max_split_size_mb"] = str(split // MiB)
    threshold = recorded.get("garbage_collection_threshold")
    if isinstance(threshold, (int, float)) and 0 < threshold < 1:
        items["garbage_collection_threshold"] = repr(float(threshold))
    # Keys of any type may come from a damaged file: sorted by their text.
    fields = sorted(recorded, key=str)
    unknown = [f"{k} (recorded field)" for k in fields if k not in _FIELDS and k not in _STRING_KEYS]
    # The recorded switch is the one PyTorch used: off, whatever the string asked, where the
    # platform lacks expandable segments (PyTorch warns once and runs its plain segments).
    if recorded.get("expandable_segments") is True:
        items["expandable_segments"] = "True"
    elif recorded.get("expandable_segments") is False and items.get("expandable_segments") == "True":
        del items["expandable_segments"]
        unknown.append("expandable_segments:True (recorded as off: PyTorch ran its plain segments)")
    try:
        if divisions := _divisions(recorded.get("roundup_power2_divisions")):
            items["roundup_power2_divisions"] = divisions
    except ValueError as error:
        unknown.append(f"roundup_power2_divisions (recorded field: {error})")
    kept: dict[str, str] = {}
    for key, value in items.items():
        # Checked with the items kept before it, so one that contradicts them (expandable
        # segments under backend:cudaMallocAsync) is named and left out too.
        try:
            _native.inert_keys(",".join(f"{k}:{v}" for k, v in {**kept, key: value}.items()))
        except ValueError as error:
            unknown.append(f"{key}:{value} ({error})")
            continue
        kept[key] = value
    env = ",".join(f"{key}:{value}" for key, value in kept.items())
    return Settings(env, recorded=True, inert=_native.inert_keys(env), unknown=unknown)


def gpupool_config(env: str) -> str:
    """The gpupool configuration that behaves as PyTorch's allocator with ``env`` set: its rules,
    its expandable segments, or no pooling for the driver's allocator, and never a block passed
    to another stream."""
    items = _items(env)
    if items.get("backend") == "cudaMallocAsync":
        return env
    strategy = "expandable" if items.get("expandable_segments") == "True" else "pytorch"
    return ",".join(filter(None, (f"strategy:{strategy}", "cross_stream_reuse:never", env)))
