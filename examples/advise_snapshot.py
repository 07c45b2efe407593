"""What ``gpupool advise`` answers about a PyTorch memory snapshot, read from a program.

It advises on the shipped example (a training loop that died of an out-of-memory error on a
2 GiB GPU; examples/make_snapshot.py wrote it), prints the answer, then reads the same figures
from ``advice.as_dict()``, the object ``gpupool advise --json`` prints: a program takes the
string to set from ``config`` (empty for PyTorch's defaults) and shows people ``label``.

    python examples/advise_snapshot.py [SNAPSHOT]
"""

import json
import pathlib
import sys

import gpupool

SHIPPED = pathlib.Path(__file__).resolve().parent / "snapshots" / "training_step.pickle"


def gib(size: int | None) -> str:
    """A size in GiB; None where no device size the search tried fits."""
    return "-" if size is None else f"{size / (1 << 30):.2f} GiB"


path = sys.argv[1] if len(sys.argv) > 1 else SHIPPED
advice = gpupool.advise(path)
recorded_peak = gib(advice.recorded.peak_reserved_bytes)
print(f"{pathlib.Path(advice.trace).name}: {advice.recorded.label} reserved at most {recorded_peak}")
if advice.gpu_capacity_bytes is not None:
    print(f"the job had about {gib(advice.gpu_capacity_bytes)} of the GPU (from its {advice.capacity_source})")
for recommendation in advice.recommended.values():
    print(f"set {recommendation.env}  (needs {gib(recommendation.min_capacity_bytes)})")

# The --json answer: sizes in bytes, `config` for programs, `label` for people.
answer = json.loads(json.dumps(advice.as_dict()))
recorded = answer["recorded"]
print(f"\nrecorded: config={recorded['config']!r} label={recorded['label']!r}")
print(f"recorded: {recorded['empty_cache_calls']} empty_cache() call(s), {recorded['ooms']} out-of-memory error(s)")
for family, chosen in answer["recommended"].items():
    saved = "-" if chosen["saved_fraction"] is None else f"{chosen['saved_fraction']:.1%}"
    needs = gib(chosen["min_capacity_bytes"])
    print(f"recommended[{family!r}]: config={chosen['config']!r} min_capacity={needs} saves {saved}")
if answer["capacity_bytes"] is not None:  # the size given, else the GPU the job had; fits is None without one
    fit = [c["label"] for c in answer["candidates"] if c["fits"]]
    on = gib(answer["capacity_bytes"])
    print(f"{len(fit)} of {len(answer['candidates'])} configurations fit {on}: {', '.join(fit)}")
