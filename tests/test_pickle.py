"""The native pickle reader: the same plain data as ``pickle.loads``, and nothing else, quickly.

Equality is checked on object graphs: two results are the same when ``pickle.dumps`` writes them
to the same bytes, which compares types, values (nan and -0.0 included) and which objects are
shared (the pickler memoizes by identity).
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool._native import load_pickle
from pool_checks import EXAMPLES_SCALE

SNAPSHOTS = sorted((Path(__file__).resolve().parents[1].parent / "shared" / "snapshots").glob("*.pickle"))
PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)
REFUSED = {
    "GLOBAL",
    "STACK_GLOBAL",
    "REDUCE",
    "BUILD",
    "INST",
    "OBJ",
    "NEWOBJ",
    "NEWOBJ_EX",
    "PERSID",
    "BINPERSID",
    "EXT1",
    "EXT2",
    "EXT4",
    "NEXT_BUFFER",
    "READONLY_BUFFER",
}
OPCODE = {op.name: op.code.encode("latin-1") for op in pickletools.opcodes}


def graph(value) -> bytes:
    return pickle.dumps(value, protocol=5)


class _Refusing(pickle.Unpickler):
    """CPython's reader with every global refused: what gpupool used before the native reader."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}")


def refusing_loads(data: bytes):
    return _Refusing(io.BytesIO(data)).load()


# Python writes bytes below protocol 3, sets below 4 and bytearrays below 5 as calls to
# constructors (GLOBAL + REDUCE); those forms are refused, so each protocol gets only the types
# it writes as data.
def scalars(protocol: int, nan: bool = True) -> st.SearchStrategy:
    options = [
        st.none(),
        st.booleans(),
        st.integers(),
        # Protocols 0 and 1 write ints as decimal text, which Python caps at 4300 digits.
        st.integers(-(2**4000), 2**4000),
        st.floats(allow_nan=nan),
        st.text(),
    ]
    if protocol >= 3:
        options.append(st.binary())
    return st.one_of(options)


# Dict keys and set members the reader takes: flat, so hashing them can neither recurse nor be
# made to collide (ints beyond 64 bits can all share one hash).
INT64 = st.integers(-(2**63), 2**64 - 1)


def keys(protocol: int) -> st.SearchStrategy:
    # No nan: nan keys hash by identity, which makes Hypothesis's unique draws irreproducible.
    options = [st.none(), st.booleans(), INT64, st.floats(allow_nan=False), st.text()]
    if protocol >= 3:
        options.append(st.binary())
    return st.one_of(options)


def hashables(protocol: int) -> st.SearchStrategy:
    """What Python can hash: keys, and tuples, frozensets and big ints, which the reader refuses."""

    def extend(inner):
        options = [st.lists(inner, max_size=4).map(tuple)]
        if protocol >= 4:
            options.append(st.frozensets(inner, max_size=4))
        return st.one_of(options)

    return st.recursive(keys(protocol) | st.integers(), extend, max_leaves=8)


def is_key(value) -> bool:
    return value is None or type(value) in (bool, float, str, bytes) or type(value) is int and -(2**63) <= value < 2**64


def trees(protocol: int) -> st.SearchStrategy:
    leaves = scalars(protocol)
    if protocol >= 5:
        leaves = leaves | st.binary().map(bytearray)

    def extend(inner):
        options = [
            st.lists(inner, max_size=5),
            st.lists(inner, max_size=5).map(tuple),
            st.dictionaries(keys(protocol), inner, max_size=5),
        ]
        if protocol >= 4:
            options += [st.sets(keys(protocol), max_size=5), st.frozensets(keys(protocol), max_size=5)]
        return st.one_of(options)

    return st.recursive(leaves, extend, max_leaves=20)


@st.composite
def plain_values(draw, protocol: int):
    """A tree, or containers referring to the same few trees many times (a DAG)."""
    pieces = draw(st.lists(trees(protocol), min_size=1, max_size=4))
    picks = st.sampled_from(pieces)
    return draw(
        st.one_of(
            picks,
            st.lists(picks, max_size=6),
            st.lists(picks, max_size=6).map(tuple),
            st.dictionaries(st.text(max_size=3), picks, max_size=4),
        )
    )


# Nested values are slow to generate; six protocols share the profile's budget.
@pytest.mark.parametrize("protocol", PROTOCOLS)
@settings(max_examples=60 * EXAMPLES_SCALE)
@given(data=st.data())
def test_plain_values_load_as_pickle_loads_them(protocol, data):
    value = data.draw(plain_values(protocol))
    pickled = pickle.dumps(value, protocol=protocol)
    for form in (pickled, pickletools.optimize(pickled)):
        assert graph(load_pickle(form)) == graph(pickle.loads(form))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_references_and_cycles_stay_shared(protocol):
    dag = []
    for _ in range(200):  # 2**200 paths from the root: only sharing keeps this small
        dag = [dag, dag]
    cyclic = [1]
    cyclic.append(cyclic)
    knot: dict = {"self": None}
    knot["self"] = knot
    inner: list = []
    through_tuple = (inner, "x")
    inner.append(through_tuple)  # a cycle through a tuple: pickled with POP or POP_MARK
    value = [dag, cyclic, knot, through_tuple, "\ud800 lone surrogate", -0.0, float("nan")]
    pickled = pickle.dumps(value, protocol=protocol)
    loaded = load_pickle(pickled)
    assert graph(loaded) == graph(pickle.loads(pickled))
    node = loaded[0]
    while node:
        assert node[0] is node[1]
        node = node[0]
    assert loaded[1][1] is loaded[1]
    assert loaded[2]["self"] is loaded[2]
    assert loaded[3][0][0] is loaded[3]


@pytest.mark.parametrize(
    "opcode",
    [
        lambda raw: b"S" + repr(raw)[1:].encode() + b"\n",
        lambda raw: b"T" + struct.pack("<i", len(raw)) + raw,
        lambda raw: b"U" + bytes([len(raw)]) + raw,
    ],
    ids=["STRING", "BINSTRING", "SHORT_BINSTRING"],
)
@given(raw=st.binary(max_size=255))
def test_python2_strings_read_as_pickle_loads_reads_them(opcode, raw):
    """Python 2 ``str``: ASCII by default, like ``pickle.loads``; other bytes refused."""
    data = opcode(raw) + b"."
    try:
        expected = pickle.loads(data)
    except UnicodeDecodeError:
        with pytest.raises(ValueError, match="codec can't decode"):
            load_pickle(data)
    else:
        assert graph(load_pickle(data)) == graph(expected)


@pytest.mark.parametrize(
    ("value", "protocols", "global_name"),
    [
        (b"bytes", range(3), r"_codecs\.encode"),
        ({1, 2}, range(4), r"(__builtin__|builtins)\.set"),
        (frozenset({1}), range(4), r"(__builtin__|builtins)\.frozenset"),
        (bytearray(b"x"), range(5), r"(__builtin__|builtins)\.bytearray"),
    ],
)
def test_types_older_protocols_write_as_calls_are_refused_as_before(value, protocols, global_name):
    for protocol in protocols:
        pickled = pickle.dumps(value, protocol=protocol)
        with pytest.raises(ValueError, match=rf"it holds a {global_name} object \((STACK_)?GLOBAL at byte \d+\)"):
            load_pickle(pickled)
        with pytest.raises(pickle.UnpicklingError):
            refusing_loads(pickled)


@pytest.mark.skipif(not SNAPSHOTS, reason="../shared/snapshots is not here")
@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda path: path.name)
def test_real_snapshots_load_as_the_refusing_c_unpickler_loads_them(path):
    data = path.read_bytes()
    assert graph(load_pickle(data)) == graph(refusing_loads(data))


class _System:
    """Unpickling this would run a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.skipif(os.name != "posix", reason="the command is POSIX shell")
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_pickle_calling_os_system_is_refused_without_running_it(tmp_path, protocol):
    target = tmp_path / "pwned"
    pickled = pickle.dumps(_System(f"touch {target}"), protocol=protocol)
    opcode = "STACK_GLOBAL" if protocol >= 4 else "GLOBAL"
    message = rf"^it holds a (posix|os)\.system object \({opcode} at byte \d+\); only plain dicts, lists"
    with pytest.raises(ValueError, match=message):
        load_pickle(pickled)
    assert not target.exists()


def test_code_opcodes_are_refused_naming_opcode_and_offset():
    cases = {
        b"cos\nsystem\n(S'true'\ntR.": r"a os\.system object \(GLOBAL at byte 0\)",
        b"\x80\x04\x8c\x02os\x8c\x06system\x93.": r"a os\.system object \(STACK_GLOBAL at byte 14\)",
        b"\x80\x04K\x01K\x02\x93.": r"a reference to a global \(STACK_GLOBAL at byte 6\)",
        b"\x80\x02N)R.": r"a function call \(REDUCE at byte 4\)",
        b"\x80\x02}}b.": r"an object's state \(BUILD at byte 4\)",
        b"\x80\x02(ios\nsystem\n.": r"a os\.system object \(INST at byte 3\)",
        b"\x80\x02N\x82\x01.": r"a registered extension \(EXT1 at byte 3\)",
        b"\x80\x05\x97.": r"an out-of-band buffer \(NEXT_BUFFER at byte 2\)",
    }
    for data, what in cases.items():
        message = rf"^it holds {what}; only plain dicts, lists, strings and numbers are read$"
        with pytest.raises(ValueError, match=message):
            load_pickle(data)


def test_every_opcode_python_knows_is_read_or_refused_by_name():
    for name, code in OPCODE.items():
        with pytest.raises(ValueError) as refused:
            load_pickle(code)
        message = str(refused.value)
        assert "unknown opcode" not in message
        assert (message.startswith("it holds") and f"({name} at byte 0)" in message) == (name in REFUSED), message
    for unknown in sorted(set(range(256)) - {code[0] for code in OPCODE.values()}):
        with pytest.raises(ValueError, match=rf"^unknown opcode 0x{unknown:02x} at byte 0$"):
            load_pickle(bytes([unknown]) + b".")


@pytest.mark.parametrize("container", ["dict", "set", "frozenset"])
@given(key=hashables(4))
def test_only_flat_keys_are_read(container, key):
    value = {"dict": {key: 1}, "set": {key}, "frozenset": frozenset({key})}[container]
    pickled = pickle.dumps(value, protocol=4)
    if is_key(key):
        assert graph(load_pickle(pickled)) == graph(pickle.loads(pickled))
    else:
        with pytest.raises(ValueError, match=r"at byte \d+: a (dict key|set member) is a"):
            load_pickle(pickled)


def test_ints_sharing_one_hash_are_refused_as_keys():
    # Python hashes an int n as n % (2**61 - 1): these all collide.
    colliding = {n * (2**61 - 1): None for n in range(1000)}
    with pytest.raises(ValueError, match=r"SETITEMS at byte \d+: a dict key is an int beyond 64 bits"):
        load_pickle(pickle.dumps(colliding, protocol=4))
    widest = {-(2**63): 1, 2**64 - 1: 2}
    assert load_pickle(pickle.dumps(widest)) == widest


# Malformed programs that CPython's reader refuses too (with an exception type that varies by opcode).
CPYTHON_ERRORS = (pickle.UnpicklingError, ValueError, TypeError, AttributeError, EOFError, KeyError, IndexError)
MALFORMED = {
    "STOP on an empty stack": (b"\x80\x02(.", r"STOP at byte 3: too few items on the stack"),
    "APPEND reaching below a MARK": (b"\x80\x02]N(a.", r"APPEND at byte 5: too few items"),
    "APPENDS without a MARK": (b"\x80\x02]Ne.", r"APPENDS at byte 4: no MARK is open"),
    "POP_MARK without a MARK": (b"\x80\x021.", r"POP_MARK at byte 2: no MARK is open"),
    "TUPLE2 of one item": (b"\x80\x02N\x86.", r"TUPLE2 at byte 3: too few items"),
    "APPEND to a dict": (b"\x80\x02}Na.", r"APPEND at byte 4: cannot add items to a dict"),
    "SETITEMS with a key only": (b"\x80\x02}(Nu.", r"SETITEMS at byte 5: an odd number of items \(1\)"),
    "DICT with a key only": (b"\x80\x02(Nd.", r"DICT at byte 4: an odd number of items"),
    "a list as a dict key": (b"\x80\x02}]Ns.", r"SETITEM at byte 5: a dict key is a list"),
    "a list in a set": (b"\x80\x04\x8f(]\x90.", r"ADDITEMS at byte 5: a set member is a list"),
    "a list in a frozenset": (b"\x80\x04(]\x91.", r"FROZENSET at byte 4: a set member is a list"),
    "GET of a key never stored": (b"\x80\x02Nh\x05.", r"BINGET at byte 3: memo key 5 was never stored"),
    "PUT on an empty stack": (b"\x80\x02q\x00N.", r"BINPUT at byte 2: too few items"),
    "an unknown protocol": (b"\x80\x06N.", r"PROTO at byte 0: unsupported protocol 6"),
    "a negative LONG4 length": (b"\x80\x02\x8b\xff\xff\xff\xff.", r"LONG4 at byte 2: negative byte count -1"),
    "no STOP": (b"\x80\x02N", r"the data ends at byte 3 without a STOP opcode"),
    "an unknown opcode": (b"\x80\x02N\xff.", r"unknown opcode 0xff at byte 3"),
    "an int over Python's digit limit": (b"L" + b"9" * 5000 + b"L\n.", r"LONG at byte 0: ValueError: Exceeds"),
    "UTF-8 that is not": (b"\x8c\x01\xff.", r"SHORT_BINUNICODE at byte 0: UnicodeDecodeError"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_programs_are_value_errors_where_cpython_also_fails(case):
    data, message = MALFORMED[case]
    with pytest.raises(ValueError, match=f"^{message}"):
        load_pickle(data)
    with pytest.raises(CPYTHON_ERRORS):
        pickle.loads(data)


def test_corner_cases_cpython_accepts():
    for data in [
        b"\x80\x02N(u.",  # SETITEMS adding nothing never looks at its target
        b"\x80\x02N.trailing garbage is never read",
        b"\x80\x02N(0.",  # POP drops a MARK with nothing above it
        b"\x80\x02]\x94(h\x00h\x00l.",  # a new list holding a memoized one twice
        b"\x80\x02]2a.",  # DUP then APPEND: a list containing itself
        b"(lp0\nI5\naI01\naF-0.0\naVa\\u20acb\nag0\na.",  # protocol 0 text forms
        b"(I01\nI00\nI-5\nL12L\nL-7\nF-inf\nFnan\nt.",  # INT 01 and 00 are True and False
    ]:
        assert graph(load_pickle(data)) == graph(pickle.loads(data))


# Opcodes with valid arguments, from which random programs are drawn.
PIECES = [
    *(OPCODE[name] for name in ["MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE", "EMPTY_LIST"]),
    *(OPCODE[name] for name in ["APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE"]),
    *(OPCODE[name] for name in ["EMPTY_DICT", "SETITEM", "SETITEMS", "DICT", "EMPTY_SET", "ADDITEMS", "FROZENSET"]),
    *(OPCODE[name] for name in ["MEMOIZE", "STACK_GLOBAL"]),
    *(b"q" + bytes([key]) for key in range(3)),
    *(b"h" + bytes([key]) for key in range(3)),
    b"p0\n",
    b"g0\n",
    b"K\x05",
    b"J\xff\xff\xff\xff",
    b"\x8a\x01\x80",
    b"\x8a\x09" + bytes(range(9)),
    b"I01\n",
    b"L99999999999999999999L\n",
    b"F2.5\n",
    b"G" + struct.pack(">d", 1.5),
    b"\x8c\x01a",
    b"X\x01\x00\x00\x00b",
    b"Vx\\u20ac\n",
    b"S'ab'\n",
    b"U\x01c",
    b"C\x01z",
]


@given(st.lists(st.sampled_from(PIECES), max_size=14))
def test_random_programs_succeed_and_fail_as_cpython_does(pieces):
    data = b"\x80\x04" + b"".join(pieces) + b"."
    try:
        expected = refusing_loads(data)
    except CPYTHON_ERRORS:
        with pytest.raises(ValueError):
            load_pickle(data)
        return
    try:
        loaded = load_pickle(data)
    except ValueError as error:
        # CPython's SETITEM assigns to any object (a list by index); gpupool's fills dicts only,
        # and only with flat keys.
        refusals = r"cannot add items to a list$|a (dict key|set member) is a"
        assert re.match(rf"\w+ at byte \d+: ({refusals})", str(error)), error
        return
    assert graph(loaded) == graph(expected)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_truncation_of_a_pickle_is_a_value_error(protocol):
    value = {"segments": [{"address": 2**40, "blocks": [(1, -2.5, "s", None, True)]}], "big": -(2**100), "n": 7}
    if protocol >= 4:
        value["set"] = {1, "two"}
    pickled = pickle.dumps(value, protocol=protocol)
    for end in range(len(pickled)):
        with pytest.raises(ValueError):
            load_pickle(pickled[:end])


# Hostile inputs run in a child whose address space is capped: a check that fails to stop a
# huge allocation kills the child (a clean test failure) instead of the machine.
CHILD = """
import resource, sys
from gpupool._native import load_pickle
data = sys.stdin.buffer.read()
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.RLIM_INFINITY))
try:
    value = load_pickle(data)
except ValueError as error:
    print("ValueError:", error)
else:
    depth = 0
    while isinstance(value, (list, tuple)) and value:
        value, depth = value[0], depth + 1
    print("depth", depth)
"""
DEEP = 1_000_000
DEEP_TUPLE = b"N" + b"\x85" * DEEP  # None in a 1-tuple in a 1-tuple ...
HOSTILE = {
    "LONG_BINPUT 0xFFFFFFF0": (
        b"\x80\x02Nr\xf0\xff\xff\xff.",
        r"ValueError: LONG_BINPUT at byte 3: memo index 4294967280 is beyond the 3 opcodes read so far",
    ),
    "PUT 2**40": (b"Np1099511627776\n.", r"ValueError: PUT at byte 1: memo index 1099511627776 is beyond"),
    "LONG_BINGET 0xFFFFFFF0": (b"\x80\x02Nj\xf0\xff\xff\xff.", r"ValueError: LONG_BINGET at byte 3: memo key"),
    "BINUNICODE8 2**62": (
        b"\x80\x04\x8d" + struct.pack("<Q", 2**62) + b"x.",
        r"ValueError: BINUNICODE8 at byte 2 claims 4611686018427387904 bytes, but only 2 follow",
    ),
    "BINBYTES8 2**62": (b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b".", r"ValueError: BINBYTES8 at byte 2 claims"),
    "BYTEARRAY8 2**62": (b"\x80\x05\x96" + struct.pack("<Q", 2**62) + b".", r"ValueError: BYTEARRAY8 at byte 2 claims"),
    "FRAME 2**62": (b"\x80\x04\x95" + struct.pack("<Q", 2**62) + b"N.", r"ValueError: FRAME at byte 2 claims"),
    "LONG4 of 2**31 bytes": (b"\x80\x02\x8b" + struct.pack("<I", 2**31) + b".", r"ValueError: LONG4 at byte 2: negat"),
    "LONG4 of 2**31-1 bytes": (
        b"\x80\x02\x8b" + struct.pack("<I", 2**31 - 1) + b".",
        r"ValueError: LONG4 at byte 2 claims 2147483647 bytes",
    ),
    "BINUNICODE 2**32-1": (b"\x80\x02X\xff\xff\xff\xff.", r"ValueError: BINUNICODE at byte 2 claims 4294967295 bytes"),
    "1e6 nested lists": (b"\x80\x04" + b"]" * DEEP + b"a" * (DEEP - 1) + b".", rf"depth {DEEP - 1}$"),
    "1e6 nested tuples": (b"\x80\x04" + b"(" * DEEP + b")" + b"t" * DEEP + b".", rf"depth {DEEP}$"),
    "1e6 MARKs": (b"\x80\x04" + b"(" * DEEP + b".", r"ValueError: STOP at byte \d+: too few items"),
    # Hashing a nested tuple recurses in C, one level per tuple, and would overflow the stack.
    "a 1e6-deep tuple as a dict key": (
        b"\x80\x04}" + DEEP_TUPLE + b"Ns.",
        r"ValueError: SETITEM at byte \d+: a dict key is a tuple",
    ),
    "a 1e6-deep tuple in a set": (
        b"\x80\x04\x8f(" + DEEP_TUPLE + b"\x90.",
        r"ValueError: ADDITEMS at byte \d+: a set member is a tuple",
    ),
    "a 1e6-deep tuple in a frozenset": (
        b"\x80\x04(" + DEEP_TUPLE + b"\x91.",
        r"ValueError: FROZENSET at byte \d+: a set member is a tuple",
    ),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps memory on Linux")
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_refused_without_allocating_or_recursing(case):
    data, expected = HOSTILE[case]
    child = subprocess.run([sys.executable, "-c", CHILD], input=data, capture_output=True, timeout=120, check=False)
    out = child.stdout.decode().strip()
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr.decode()[-2000:]}"
    assert re.search(expected, out), out


# The child caps its address space a little above what it has mapped, so the reader's stack,
# marks or memo outgrow it after a few million opcodes.
OUT_OF_MEMORY_CHILD = """
import resource, sys
from gpupool._native import load_pickle
data = sys.stdin.buffer.read()
with open("/proc/self/statm") as statm:
    mapped = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (32 << 20), resource.RLIM_INFINITY))
try:
    load_pickle(data)
except MemoryError as error:
    print("MemoryError:", error)
"""
LONG = 8 << 20
GROWING = {
    "the stack": b"N" * LONG,
    "the marks": b"(" * LONG,
    "the memo": b"N" + b"\x94" * LONG,
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps memory on Linux")
@pytest.mark.parametrize("case", list(GROWING))
def test_running_out_of_memory_is_a_memory_error_not_an_abort(case):
    data = b"\x80\x04" + GROWING[case] + b"."
    child = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY_CHILD], input=data, capture_output=True, timeout=60, check=False
    )
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr.decode()[-2000:]}"
    assert child.stdout.decode().startswith("MemoryError: out of memory for the pickle reader"), child.stdout
