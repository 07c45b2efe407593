"""Builds tests/fake_cuda/fake_cuda.c into a libcuda and runs Python snippets against it.

cudarc finds the fake through its ordinary dynamic loading, so each snippet runs in a child
process whose LD_LIBRARY_PATH starts with the fake's directory (the loader reads it at start-up,
and a process can load one libcuda only). Nothing measured here says anything about a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

SOURCE = Path(__file__).parent / "fake_cuda" / "fake_cuda.c"

# Imported by every snippet: the fake's test controls, reached through the already-loaded library.
PRELUDE = """
import ctypes, json, sys
import gpupool
from gpupool import _native

def driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.fake_cuda_calls.restype = ctypes.c_ulonglong
    lib.fake_cuda_violations.restype = ctypes.c_ulonglong
    lib.fake_cuda_mappings.restype = ctypes.c_ulonglong
    lib.fake_cuda_used.restype = ctypes.c_ulonglong
    lib.fake_cuda_launch.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_ubyte]
    lib.fake_cuda_complete.argtypes = [ctypes.c_void_p]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    return lib

def calls(name):
    return driver().fake_cuda_calls(name.encode())

def violations():
    return driver().fake_cuda_violations()

def mappings():
    return driver().fake_cuda_mappings()

def current_context():
    context = ctypes.c_void_p()
    assert driver().cuCtxGetCurrent(ctypes.byref(context)) == 0
    return context.value or 0

def use_context(ordinal=0):
    # What a framework does before it launches work: make the device's primary context current.
    assert gpupool.device_count() > ordinal  # also initializes the driver
    device, context = ctypes.c_int(), ctypes.c_void_p()
    assert driver().cuDeviceGet(ctypes.byref(device), ordinal) == 0
    assert driver().cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    assert driver().cuCtxSetCurrent(context) == 0
    return context.value

def launch(stream, address, size, tag=0xAA):
    # A kernel that writes `tag` over the range once finished (complete()) or waited for.
    assert driver().fake_cuda_launch(stream, address, size, tag) == 0

def complete(stream):
    assert driver().fake_cuda_complete(stream) == 0

def report(**values):
    print("RESULT " + json.dumps(values))
"""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def build(directory: Path, hidden: tuple[str, ...] = ()) -> Path:
    """Compiles the fake into ``directory`` as libcuda.so.1 (+ libcuda.so), hiding ``hidden``."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [compiler(), "-shared", "-fPIC", "-O1", "-Wall", "-Wl,-soname,libcuda.so.1"]
    if hidden:
        script = directory / "hide.map"
        script.write_text("{\n  global: *;\n  local: " + "; ".join(hidden) + ";\n};\n")
        command.append(f"-Wl,--version-script={script}")
    library = directory / "libcuda.so.1"
    subprocess.run([*command, "-o", str(library), str(SOURCE), "-lpthread"], check=True)
    (directory / "libcuda.so").unlink(missing_ok=True)
    (directory / "libcuda.so").symlink_to("libcuda.so.1")
    return directory


def run(snippet: str, library: Path | None, env: dict[str, str] | None = None, **switches: object) -> dict:
    """Runs ``snippet`` (after PRELUDE) with the fake in ``library`` (None: no driver at all),
    the extra environment ``env`` and the FAKE_CUDA_* ``switches``; returns what it passed to
    ``report``."""
    extra = env or {}
    env = {key: value for key, value in os.environ.items() if not key.startswith("FAKE_CUDA_")}
    env.update(extra)
    env["LD_LIBRARY_PATH"] = str(library) if library else ""
    env.update({f"FAKE_CUDA_{key.upper()}": str(value) for key, value in switches.items()})
    code = PRELUDE + textwrap.dedent(snippet)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        raise AssertionError(f"snippet failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(results[-1].removeprefix("RESULT "))
