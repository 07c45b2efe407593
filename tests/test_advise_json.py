"""``gpupool advise --json`` as programs read it: it validates against the schema shipped in the
package, every ``config`` is a string its variable accepts (never a label), and
docs/reference/advise-json.md explains exactly the schema's fields."""

from __future__ import annotations

import copy
import json
import pathlib
import re
from typing import Any

import pytest
from advice_snapshots import shared_snapshot, warmed_up
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

import gpupool
from gpupool import cli
from gpupool import trace as gtrace
from gpupool._advice import candidates as _candidates
from gpupool._advice.settings import _items, gpupool_config

MiB = 1 << 20
# One with a history, one with only the final segments (and no recorded settings).
WITH_HISTORY = "Wedsonlin__medium_128_inference_memory_snapshot.pickle"
SEGMENTS_ONLY = "LLM-inference__1.3b_snapshot_08fa910.pickle"
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reference" / "advise-json.md"
VARIABLES = {"pytorch": "PYTORCH_ALLOC_CONF", "gpupool": "GPUPOOL_ALLOC_CONF"}
# gpupool's own keys: a PYTORCH_ALLOC_CONF value with one of them is gpupool's string, not PyTorch's.
GPUPOOL_ONLY_KEYS = {
    "strategy",
    "large_segment_size_mb",
    "release_threshold",
    "initial_pool_size_mb",
    "page_size_mb",
    "cross_stream_reuse",
    "shareable_handle",
    "peer_access",
}


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = gpupool.advise_schema()
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.fixture(scope="module")
def with_history() -> dict[str, Any]:
    """The JSON object of WITH_HISTORY's advice."""
    [advice] = gpupool.advise_each(shared_snapshot(WITH_HISTORY))
    return json.loads(json.dumps(advice.as_dict()))


@pytest.fixture(scope="module")
def tiny_trace() -> gtrace.Trace:
    entries, segments = warmed_up()
    return gtrace.from_snapshot({"device_traces": [entries], "segments": segments})


def advise_json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert cli.main(["advise", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def errors(validator: Draft202012Validator, instance: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(instance)]


def check_configs(obj: dict[str, Any], trace: gtrace.Trace) -> None:
    """Every ``config`` of ``obj`` (one advice) is what its family's variable takes, and replays."""
    for c in obj["candidates"]:
        config = c["config"]
        assert c["env"] == config
        assert c["label"] == (config or "PyTorch defaults"), c
        if c["family"] == "pytorch":
            assert not set(_items(config)) & GPUPOOL_ONLY_KEYS, f"{config!r} is not a PYTORCH_ALLOC_CONF value"
            # What advise replayed is what the PyTorch setting converts to.
            assert c["gpupool_config"] == gpupool_config(config), c
        else:
            assert c["gpupool_config"] == config, c
        gpupool.replay(trace, config=c["gpupool_config"])
        gpupool.replay(trace, config=gpupool_config(config) if c["family"] == "pytorch" else config)
    for family, r in obj["recommended"].items():
        assert r["family"] == family
        assert r["env"] == f"{VARIABLES[family]}={r['config']}"
        [chosen] = [c for c in obj["candidates"] if c["family"] == family and c["config"] == r["config"]]
        assert r["label"] == chosen["label"]
        assert r["min_capacity_bytes"] == chosen["min_capacity_bytes"]
    recorded = obj["recorded"]
    [as_run] = [c for c in obj["candidates"] if c["as_run"]]
    assert (as_run["config"], as_run["label"]) == (recorded["config"], recorded["label"])


@pytest.mark.parametrize("name", [WITH_HISTORY, SEGMENTS_ONLY])
@pytest.mark.parametrize("capacity", [None, "2GiB"])
def test_the_json_of_a_shared_snapshot_validates_and_its_configs_are_accepted(
    name, capacity, capsys, validator, tiny_trace
):
    argv = [str(shared_snapshot(name))] + (["--capacity", capacity] if capacity else [])
    out = advise_json(capsys, *argv)
    assert errors(validator, out) == []
    [obj] = out
    assert obj["scope"] == ("history" if name == WITH_HISTORY else "segments")
    check_configs(obj, tiny_trace)
    # Both ran PyTorch's defaults: the as-run candidate's config is the empty string.
    [as_run] = [c for c in obj["candidates"] if c["as_run"]]
    assert (as_run["config"], as_run["label"], as_run["family"]) == ("", "PyTorch defaults", "pytorch")
    assert (obj["recorded"]["config"], obj["recorded"]["label"]) == ("", "PyTorch defaults")
    assert {c["config"] for c in obj["candidates"] if c["family"] == "gpupool"} == {
        f"strategy:{s}" for s in _candidates.GPUPOOL_STRATEGIES
    }
    assert all((c["fits"] is None) == (capacity is None) for c in obj["candidates"])


def test_the_reports_still_print_the_labels(capsys):
    path = str(shared_snapshot(WITH_HISTORY))
    assert cli.main(["advise", path]) == 0
    text = capsys.readouterr().out
    assert "What you ran: PyTorch defaults (recorded in the snapshot)" in text
    assert "\nPyTorch defaults (as run) " in text


def _drop(obj: dict[str, Any], *path: Any) -> None:
    *parents, last = path
    for key in parents:
        obj = obj[key]
    del obj[last]


def _set(obj: dict[str, Any], value: Any, *path: Any) -> None:
    *parents, last = path
    for key in parents:
        obj = obj[key]
    obj[last] = value


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (_drop, ("recorded", "label")),
        (_drop, ("candidates", 0, "gpupool_config")),
        (_drop, ("recommended", "gpupool")),
        (_set, ("an extra field", "candidates", 0, "extra")),
        (_set, ("an extra field", "extra")),
        (_set, ("1", "device")),
        (_set, (1.5, "peak_live_bytes")),
        (_set, (None, "candidates", 0, "peak_reserved_bytes")),
        (_set, ("cuda", "candidates", 0, "family")),
        (_set, (False, "candidates", 0, "as_run")),
        (_set, ("pytorch", "recommended", "gpupool", "family")),
        (_set, ("strategy:default", "recommended", "gpupool", "env")),
        (_set, (1.5, "recorded", "segment_decisions_matched")),
        (_set, ("somewhere", "recorded", "replayed_from")),
        (_set, ([{"frame": "a.py:1 (f)"}], "top_sites")),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else "/".join(map(str, v)),
)
def test_the_schema_refuses_what_advise_never_prints(change, path, with_history, validator):
    broken = copy.deepcopy(with_history)
    change(broken, *path)
    assert errors(validator, [with_history]) == []
    assert errors(validator, [broken]) != []


def _doc_fields() -> dict[str, set[str]]:
    """The fields each table of docs/reference/advise-json.md lists, by the heading above it."""
    tables: dict[str, set[str]] = {}
    heading = ""
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            heading = line[3:]
        elif match := re.match(r"^\| `(\w+)` \|", line):
            tables.setdefault(heading, set()).add(match.group(1))
    return tables


def test_the_doc_explains_exactly_the_schemas_fields():
    defs = gpupool.advise_schema()["$defs"]
    sections = {
        "The advice object": "advice",
        "`recorded`": "recorded",
        "`candidates[]`": "candidate",
        "`recommended.pytorch`, `recommended.gpupool`": "recommendation",
        "`top_sites[]`": "site",
    }
    documented = _doc_fields()
    assert set(documented) == set(sections)
    for heading, name in sections.items():
        schema = defs[name]
        assert documented[heading] == set(schema["properties"]) == set(schema["required"]), heading
        assert schema["additionalProperties"] is False, name
    for name, schema in defs.items():
        for field, spec in schema.get("properties", {}).items():
            described = spec.get("description") or defs.get(spec.get("$ref", "").split("/")[-1], {}).get("description")
            assert described, f"{name}.{field} has no description"


SIZES = st.one_of(st.integers(1, MiB), st.integers(MiB, 10 * MiB), st.integers(10 * MiB, 48 * MiB))
OPS = st.lists(
    st.one_of(st.tuples(st.just("alloc"), SIZES), st.tuples(st.just("free"), st.integers(0, 1 << 30))),
    min_size=1,
    max_size=30,
)


def _run(pool: gpupool.Pool, ops: list[tuple[str, int]], live: list[Any]) -> None:
    for op, value in ops:
        if op == "alloc":
            live.append(pool.alloc(value))
        elif live:
            live.pop(value % len(live)).free()


@settings(max_examples=10, deadline=None)
@given(
    OPS,
    SIZES,
    OPS,
    st.sampled_from(_candidates.stock_pytorch()),
    st.sampled_from([None, 64 * MiB, 1 << 30]),
)
def test_advice_on_a_generated_history_validates(before, first, after, ran, capacity):
    # A job that ran ``before``, then recorded an allocation of ``first`` bytes and ``after``
    # under the PyTorch setting ``ran``.
    pool = gpupool.Pool("sim", capacity="64GiB", config=gpupool_config(ran))
    live: list[Any] = []
    _run(pool, before, live)
    pool.record_history()
    _run(pool, [("alloc", first), *after], live)
    snapshot = pool.snapshot()
    snapshot["allocator_settings"] = {"PYTORCH_ALLOC_CONF": ran}
    advice = gpupool.advise(snapshot, capacity=capacity)
    obj = json.loads(json.dumps(advice.as_dict()))
    assert errors(Draft202012Validator(gpupool.advise_schema()), [obj]) == []
    assert obj["recorded"]["config"] == ran
    [as_run] = [c for c in obj["candidates"] if c["as_run"]]
    assert as_run["config"] == ran and as_run["label"] == (ran or "PyTorch defaults")
    entries, segments = warmed_up()
    check_configs(obj, gtrace.from_snapshot({"device_traces": [entries], "segments": segments}))
