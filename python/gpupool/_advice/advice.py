"""What advice answers, for one device of one trace: the figures of each configuration, how the
replay of the user's settings compares with the recorded run, and the recommendations."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

# Savings below this share of the min capacity are not savings; advise's min-capacity searches
# stop within it (`ADVICE_TOLERANCE` in rust/python/advise.rs).
TOLERANCE = 0.005
# How reports name PyTorch's defaults, whose configuration string is empty.
PYTORCH_DEFAULTS = "PyTorch defaults"


def config_label(family: str, config: str) -> str:
    """How the reports name a configuration: its string, or "PyTorch defaults" for PyTorch's
    empty one. Programs read ``config``; a label is for people."""
    if family == "pytorch" and not config:
        return PYTORCH_DEFAULTS
    return config


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of what ``gpupool advise --json`` prints: a list of
    ``Advice.as_dict()`` objects. It is the authority on their fields; docs/reference/advise-json.md
    explains them."""
    text = resources.files("gpupool._advice").joinpath("advise.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


@dataclass(frozen=True)
class CandidateResult:
    """One configuration replayed from the blocks live when recording began."""

    # What the user would set: PYTORCH_ALLOC_CONF's value for family "pytorch" ("" for PyTorch's
    # defaults), GPUPOOL_ALLOC_CONF's for "gpupool".
    config: str
    family: str
    # The configuration gpupool replays it as (``gpupool.replay``'s ``config``).
    gpupool_config: str
    as_run: bool
    peak_reserved_bytes: int
    # None when no capacity the search tried fits (it gives up at about 7,500 times the peak).
    min_capacity_bytes: int | None
    # Reserved beyond the most bytes the job held: peak reserved minus peak live.
    fragmentation_bytes: int
    driver_calls: int
    # Whether it runs on the device given with ``capacity`` (None without one).
    fits: bool | None
    headroom_bytes: int | None
    # Whether the bisection's answer did not hold when replayed and a search past it found this.
    min_capacity_corrected: bool
    # (event index, reserved bytes, live bytes), each point the highest until the next.
    timeline: tuple[list[int], list[int], list[int]] = field(repr=False)

    @property
    def label(self) -> str:
        return config_label(self.family, self.config)

    @property
    def env(self) -> str:
        """The environment variable's value: ``config`` itself."""
        return self.config

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "label": self.label,
            "family": self.family,
            "env": self.env,
            "gpupool_config": self.gpupool_config,
            "as_run": self.as_run,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "min_capacity_bytes": self.min_capacity_bytes,
            "min_capacity_corrected": self.min_capacity_corrected,
            "fragmentation_bytes": self.fragmentation_bytes,
            "driver_calls": self.driver_calls,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
        }


@dataclass(frozen=True)
class Recorded:
    """What the user ran and how closely the replay of it matches the recorded run."""

    # The PYTORCH_ALLOC_CONF value in effect ("" for PyTorch's defaults).
    config: str
    settings_recorded: bool
    # From the snapshot's own segment events; None without any.
    peak_reserved_bytes: int | None
    replayed_peak_reserved_bytes: int | None
    # Share of the recorded segment decisions the replay made alike and in order.
    segment_decisions_matched: float | None
    segment_decisions: int
    replayed_segment_decisions: int | None
    # "recorded start": seeded with the segments and blocks that existed when recording began;
    # "live blocks": from the live blocks alone (a paged or driver-pooled allocator).
    replayed_from: str
    start_reserved_bytes: int
    inert_keys: list[str]
    # The most the replayed reserved bytes differed from the recorded ones at one event; None
    # where the snapshot has no segment events to rebuild the recorded curve from.
    largest_gap_bytes: int | None
    # What the job did to its pool, as the history shows it: calls of empty_cache(), releases
    # of the out-of-memory path, out-of-memory errors, and how many of those the replay of the
    # recorded settings on the job's GPU hit again.
    empty_cache_calls: int
    oom_releases: int
    ooms: int
    ooms_repeated: int
    # (event index, recorded reserved bytes) at the as-run timeline's points; empty lists
    # when unknown.
    timeline: tuple[list[int], list[int]] = field(repr=False)

    @property
    def label(self) -> str:
        return config_label("pytorch", self.config)

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "label": self.label,
            "settings_recorded": self.settings_recorded,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "replayed_peak_reserved_bytes": self.replayed_peak_reserved_bytes,
            "segment_decisions_matched": self.segment_decisions_matched,
            "segment_decisions": self.segment_decisions,
            "replayed_segment_decisions": self.replayed_segment_decisions,
            "replayed_from": self.replayed_from,
            "start_reserved_bytes": self.start_reserved_bytes,
            "inert_keys": self.inert_keys,
            "largest_gap_bytes": self.largest_gap_bytes,
            "empty_cache_calls": self.empty_cache_calls,
            "oom_releases": self.oom_releases,
            "ooms": self.ooms,
            "ooms_repeated": self.ooms_repeated,
        }


@dataclass(frozen=True)
class Recommendation:
    family: str
    # The chosen candidate's ``config``: the value of the variable ``env`` sets.
    config: str
    # The line to paste: PYTORCH_ALLOC_CONF=... or GPUPOOL_ALLOC_CONF=...
    env: str
    # None when no capacity the search tried fits even the best of the family.
    min_capacity_bytes: int | None
    # Against what the user ran (negative would be a loss; the user's own settings compete);
    # None when no capacity the search tried fits what the user ran or this.
    saved_bytes: int | None
    saved_fraction: float | None

    @property
    def label(self) -> str:
        return config_label(self.family, self.config)

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "label": self.label,
            "family": self.family,
            "env": self.env,
            "min_capacity_bytes": self.min_capacity_bytes,
            "saved_bytes": self.saved_bytes,
            "saved_fraction": self.saved_fraction,
        }


@dataclass
class Advice:
    """The answer for one device of one trace (``gpupool.advise``)."""

    trace: str
    device: int
    # The replayed trace's events: first one allocation per block live when recording began
    # (``history_start`` of them), then the recorded history.
    events: int
    history_start: int
    peak_live_bytes: int
    # "history" (allocations recorded) or "segments" (only the final segments: the figures are
    # for holding the blocks live at the snapshot).
    scope: str
    # The device size figures are checked against: given by the user, else the GPU the job had.
    capacity_bytes: int | None
    # "given", "oom entries" (inferred from the snapshot's out-of-memory errors) or None.
    capacity_source: str | None
    # The most the job could hold on its GPU, from its oom entries (device free beside reserved).
    gpu_capacity_bytes: int | None
    recorded: Recorded
    candidates: list[CandidateResult]
    recommended: dict[str, Recommendation]
    top_sites: list[tuple[str, int]]
    notes: list[str]

    @property
    def as_run(self) -> CandidateResult:
        """The result of replaying the PyTorch settings the job ran with."""
        return next(c for c in self.candidates if c.as_run)

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object, as ``schema()`` describes it."""
        return {
            "trace": self.trace,
            "device": self.device,
            "events": self.events,
            "history_start": self.history_start,
            "peak_live_bytes": self.peak_live_bytes,
            "scope": self.scope,
            "capacity_bytes": self.capacity_bytes,
            "capacity_source": self.capacity_source,
            "gpu_capacity_bytes": self.gpu_capacity_bytes,
            "recorded": self.recorded.as_dict(),
            "candidates": [c.as_dict() for c in self.candidates],
            "recommended": {family: r.as_dict() for family, r in self.recommended.items()},
            "top_sites": [{"frame": frame, "bytes_at_peak": held} for frame, held in self.top_sites],
            "notes": self.notes,
        }
