"""The configurations advice compares: what the user ran, stock PyTorch settings (each PyTorch's own
behaviour, replayed as gpupool's PyTorch presets) and gpupool's strategies."""

from __future__ import annotations

from dataclasses import dataclass

from gpupool._advice.advice import config_label
from gpupool._advice.settings import gpupool_config

# One knob at a time, each at values people set: the sweep a user would otherwise run by hand.
MAX_SPLIT_SIZES_MB = (32, 64, 128, 256, 512, 1024)
ROUNDUP_DIVISIONS = (2, 4, 8, 16)
# Garbage collection only runs with a memory fraction; 1.0 caps nothing, so the threshold alone
# decides (as a share of the device).
GC_THRESHOLDS = (0.6, 0.8)
GPUPOOL_STRATEGIES = ("default", "pages", "bfc", "arena", "eager")


@dataclass(frozen=True)
class Candidate:
    """``env`` is the line to paste: PYTORCH_ALLOC_CONF's value (family ``pytorch``) or
    GPUPOOL_ALLOC_CONF's (``gpupool``); ``config`` is what gpupool replays."""

    family: str
    env: str
    config: str
    as_run: bool = False

    @property
    def seeded(self) -> bool:
        """Whether it replays from the recorded start: PyTorch's plain segments take over the
        segments the job held; its expandable segments, where they are what ran, the pages it
        had mapped. The driver's pool, expandable segments the job did not run, and gpupool's
        strategies start from the live blocks."""
        if self.family != "pytorch":
            return False
        return self.config.startswith("strategy:pytorch") or (
            self.as_run and self.config.startswith("strategy:expandable")
        )

    @property
    def label(self) -> str:
        return config_label(self.family, self.env)


def _pytorch(env: str, as_run: bool = False) -> Candidate:
    return Candidate("pytorch", env, gpupool_config(env), as_run)


def stock_pytorch() -> list[str]:
    """The stock settings tried, as PYTORCH_ALLOC_CONF values."""
    envs = ["", "expandable_segments:True"]
    envs += [f"max_split_size_mb:{mb}" for mb in MAX_SPLIT_SIZES_MB]
    envs += [f"roundup_power2_divisions:{n}" for n in ROUNDUP_DIVISIONS]
    envs += [f"garbage_collection_threshold:{t},per_process_memory_fraction:1.0" for t in GC_THRESHOLDS]
    return envs


def candidates(as_run_env: str) -> list[Candidate]:
    """What the user ran first, then every stock setting that differs from it, then gpupool's."""
    as_run = _pytorch(as_run_env, as_run=True)
    stock = [_pytorch(env) for env in stock_pytorch()]
    pytorch = [as_run] + [c for c in stock if c.config != as_run.config]
    gpupool = [Candidate("gpupool", f"strategy:{s}", f"strategy:{s}") for s in GPUPOOL_STRATEGIES]
    return pytorch + gpupool
