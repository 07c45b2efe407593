"""Type stub of gpupool's Rust extension module; the public names are re-exported by gpupool."""

from os import PathLike
from types import TracebackType
from typing import Any

from typing_extensions import Buffer

from gpupool._view import View

def cuda_available() -> bool:
    """Whether a CUDA driver recent enough to use sees a GPU; never raises."""

def device_count() -> int:
    """GPUs the CUDA driver sees; 0 without a usable driver; never raises."""

def cuda_mem_get_info(device: int = 0) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device as the driver counts them (``cuMemGetInfo``)."""

def parse_size(text: str) -> int:
    """Bytes in a size such as ``80GiB``, ``512 MiB``, ``1.5GB`` or ``4096``."""

def parse_capacity(capacity: int | str | None) -> int | None:
    """Bytes of a device capacity (``None``, an int or a size such as ``80GiB``), checked as
    ``replay`` checks it: zero, negative or absurd is a ValueError, another type a TypeError."""

def load_pickle(data: bytes) -> Any:
    """The plain data (None, bool, int, float, str, bytes, bytearray, tuple, list, dict, set,
    frozenset) in a pickle of protocol 0 to 5, read without running code; dict keys and set
    members must be None, bool, a 64-bit int, float, str or bytes. Anything else, or a damaged
    pickle, is a ValueError naming the opcode and byte offset."""

class OutOfMemoryError(MemoryError):
    """The device refused memory even after the pool released its fully free cached segments."""

class DevicePtr:
    """One allocation; dropping the last reference frees it."""

    @property
    def ptr(self) -> int:
        """The allocation's address as an int (0 for a zero-byte allocation)."""
    @property
    def size(self) -> int:
        """Requested bytes."""
    @property
    def device(self) -> str:
        """The name of the pool's device: ``host``, ``sim`` or ``cuda:N``."""
    @property
    def freed(self) -> bool:
        """Whether the allocation was freed, by ``free()``, ``Pool.free`` or leaving a ``with`` block."""
    @property
    def exports(self) -> int:
        """Live exports of the bytes (arrays, views, DLPack capsules)."""
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """A zero-copy uint8 NumPy array (host device only, else TypeError); it pins the bytes while alive."""
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 uint8 view with the allocation's stream; CUDA devices only. Not a pin."""
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of the bytes (host and CUDA); it pins them until the consumer is done."""
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def view(self, dtype: Any, shape: int | tuple[int, ...] | None = None) -> View:
        """The memory as ``shape`` elements of ``dtype`` with the same array protocols."""
    def _export(self) -> Export: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    def free(self) -> None:
        """Returns the memory to its pool (held while exports live); a second call raises ValueError."""
    def __enter__(self) -> DevicePtr: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...
    def copy_from_host(self, data: Buffer, offset: int = 0) -> None:
        """Copies the bytes of ``data`` (any buffer-protocol object) into the allocation from byte ``offset``, after
        the work queued on its stream. A span past the allocation's end, a freed pointer or a device without copies
        (``sim``) is a ValueError."""
    def copy_to_host(self, offset: int = 0, size: int | None = None) -> bytes:
        """The allocation's bytes, or ``size`` bytes from byte ``offset``, copied into a new ``bytes``. A span past
        the allocation's end, a freed pointer or a device without copies (``sim``) is a ValueError."""
    def record_stream(self, stream: Stream) -> None:
        """Marks use on another stream: freeing waits for that stream's queued work."""

class Export:
    """A live export of an allocation's bytes: they are neither reused nor unmapped while it lives."""

    @property
    def ptr(self) -> DevicePtr:
        """The allocation exported."""
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def _dlpack(
        self,
        code: int,
        bits: int,
        shape: list[int],
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
    ) -> Any: ...

class Pool:
    """A caching pool over one device."""

    def __init__(
        self,
        device: str | None = None,
        capacity: int | str | None = None,
        config: str | None = None,
        inject_faults: dict[str, float | int | str | list[str]] | None = None,
    ) -> None:
        """``device`` is ``host``, ``sim`` or ``cuda:N``; by default ``cuda:0`` when usable, else ``host``."""
    @property
    def device(self) -> str:
        """The name of the pool's device: ``host``, ``sim`` or ``cuda:N``."""
    @property
    def capacity(self) -> int | None:
        """The capacity in bytes given when the pool was made; None if none was given."""
    @property
    def config(self) -> dict[str, str | int | float | bool | dict[str, int] | None]:
        """The effective settings by config key; None for unset or unlimited."""
    def alloc(self, size: int, stream: Stream | None = None) -> DevicePtr:
        """Allocates ``size`` bytes for use on ``stream`` (by default the default stream); 0 bytes gives an empty
        pointer. Raises OutOfMemoryError, with the request and the pool's figures in bytes, when the device cannot
        provide the memory."""
    def stream(self) -> Stream:
        """A new stream on this pool's device."""
    def external_stream(self, handle: int) -> Stream:
        """Wraps a CUDA stream made elsewhere by its raw handle (e.g. ``torch.cuda.current_stream().cuda_stream``);
        gpupool never destroys it. CUDA devices only."""
    @property
    def default_stream(self) -> Stream:
        """The pool's default stream (id 0), which allocations made without a stream use."""
    def record_stream(self, ptr: DevicePtr, stream: Stream) -> None:
        """Marks ``ptr`` as used on ``stream``: its free waits for that stream's queued work. A ``ptr`` of another
        pool is a ValueError."""
    def synchronize(self) -> None:
        """Waits for all work on every stream of the device (a device synchronize); the blocks that waited on
        it become reusable."""
    def free(self, ptr: DevicePtr) -> None:
        """Frees ``ptr`` as ``ptr.free()`` does. A ``ptr`` of another pool, or one freed already, is a ValueError."""
    def memory_stats(self) -> dict[str, int]:
        """The statistics, keyed as ``torch.cuda.memory_stats`` keys them (such as ``allocated_bytes.all.current``);
        gpupool adds counts of its driver calls (``num_driver_calls`` and one ``num_driver_<kind>`` per kind)."""
    def memory_allocated(self) -> int:
        """Bytes of the blocks now allocated (requests rounded up to block sizes), as
        ``torch.cuda.memory_allocated``."""
    def memory_reserved(self) -> int:
        """Bytes the pool now holds from the device in segments, as ``torch.cuda.memory_reserved``."""
    def max_memory_allocated(self) -> int:
        """The peak of ``memory_allocated()`` in bytes, since the pool was made or its peaks were last reset."""
    def max_memory_reserved(self) -> int:
        """The peak of ``memory_reserved()`` in bytes, since the pool was made or its peaks were last reset."""
    def reset_peak_memory_stats(self) -> None:
        """Every statistic's peak becomes its current value, as ``torch.cuda.reset_peak_memory_stats``."""
    def reset_accumulated_memory_stats(self) -> None:
        """Every statistic's ``allocated`` and ``freed`` sums and the event counts restart from 0, as
        ``torch.cuda.reset_accumulated_memory_stats``; current values and peaks stay."""
    def empty_cache(self) -> None:
        """Waits for pending frees, then returns every fully free cached segment to the device, as
        ``torch.cuda.empty_cache``."""
    def snapshot(self) -> dict[str, Any]:
        """PyTorch's snapshot dict; ``device_traces`` holds the recorded history."""
    def record_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None:
        """Records the newest ``max_entries`` events; ``enabled=False`` stops and discards."""
    def dump_trace(self, path: str | PathLike[str]) -> int:
        """Writes the recorded history as an RMM logging CSV (gzip if ``path`` ends in .gz);
        returns how many releases of cached memory the format could not say."""
    def check_invariants(self) -> None:
        """Raises AssertionError naming the broken invariant."""
    def device_memory_held(self) -> int:
        """Bytes the backend currently holds for this pool."""

class Stream:
    """A stream of one pool's device; simulated deterministically on host and sim."""

    @property
    def id(self) -> int:
        """The stream's number in its pool (0: the default stream)."""
    @property
    def handle(self) -> int | None:
        """The driver's ``cudaStream_t`` as an int (0: legacy default); None on simulated devices."""
    def hold(self) -> None:
        """Simulated devices: keeps the stream busy until synchronize()."""
    def query(self) -> bool:
        """Whether all work queued on the stream has finished."""
    def synchronize(self) -> None:
        """Waits for the stream's work; the blocks it freed or used become reusable."""
    def destroy(self) -> None:
        """Waits for the stream and destroys it (as dropping the last reference does); its live
        allocations pass to the pool's default stream, which orders their copies and frees. An
        external stream is only forgotten, and refused while allocations are made or used on it."""

class Device:
    """Direct backend access without pooling."""

    def __init__(self, kind: str = "host", capacity: int | str | None = None, mode: str = "direct") -> None:
        """``mode="async"`` on CUDA allocates through the driver's pool (``cuMemAllocAsync``)."""
    def allocate(self, size: int) -> int:
        """Allocates ``size`` bytes straight from the device and returns the address. Raises OutOfMemoryError naming
        the bytes when the device refuses."""
    def release(self, address: int) -> None:
        """Returns the allocation at ``address`` to the device; an address it did not allocate is a ValueError."""

class Trace:
    """An allocation trace, every free paired with its allocation."""

    @staticmethod
    def read_csv(path: str | PathLike[str]) -> Trace:
        """Reads an RMM logging CSV, plain or gzip-compressed."""
    @staticmethod
    def from_snapshot_entries(
        name: str,
        entries: list[tuple[str, int, int, int, float]],
        live_before: list[tuple[int, int, int]],
        final_reserved: int | None = None,
    ) -> Trace:
        """PyTorch ``device_traces`` entries ``(action, addr, size, stream, time_us)``, after
        allocating ``live_before`` ``(addr, size, stream)`` at the start (the trace's prelude:
        the blocks live before recording began). Bursts of segment releases become the job's
        ``empty_cache`` or ``oom_release`` events; ``final_reserved`` (the bytes the snapshot's
        segments hold) anchors the recorded reserved bytes."""
    @property
    def name(self) -> str:
        """Where the trace came from (a file name, for loaded traces)."""
    def __len__(self) -> int: ...
    @property
    def streams(self) -> list[int]:
        """The traced program's stream handles, in order of first use."""
    @property
    def peak_live_bytes(self) -> int:
        """The most bytes live at once, as requested."""
    @property
    def allocations(self) -> int:
        """How many allocations the trace makes (failed ones excluded)."""
    @property
    def capacity(self) -> int | None:
        """The most bytes the job could hold on its GPU, from its ``oom`` entries."""
    def action_counts(self) -> dict[str, int]:
        """How many events of each action the trace holds."""
    def events(self, start: int, stop: int) -> list[tuple[str, int, int, int, float]]:
        """Events ``start:stop`` as ``(action, address, size, stream, time_us)``."""

class ReplayResult:
    """What one replay measured."""

    @property
    def trace(self) -> str:
        """The name of the trace replayed."""
    @property
    def config(self) -> str:
        """The configuration string the pool used (empty for the default)."""
    @property
    def device(self) -> str:
        """The device the trace was replayed on, such as ``sim``."""
    @property
    def capacity(self) -> int | None:
        """The device capacity in bytes the replay was given; None if none was."""
    @property
    def events(self) -> int:
        """How many events the trace holds."""
    @property
    def peak_live_bytes(self) -> int:
        """The most bytes the trace's allocations held at once, as requested (failed ones excluded)."""
    @property
    def peak_reserved_bytes(self) -> int:
        """The most bytes the pool held from the device at once."""
    @property
    def utilization(self) -> float:
        """Peak live bytes / peak reserved bytes."""
    @property
    def device_allocs(self) -> int:
        """How many segments the pool obtained from the device."""
    @property
    def device_calls(self) -> int:
        """Driver calls that obtain or return memory, as the CUDA backend makes them."""
    @property
    def driver_calls(self) -> dict[str, int]:
        """Those calls by kind: malloc, free, reserve, unreserve, create, map, set_access, unmap, release."""
    @property
    def device_calls_per_1k_allocs(self) -> float:
        """``device_calls`` per 1,000 allocations attempted."""
    @property
    def ooms(self) -> int:
        """Allocations that did not fit: skipped, their frees ignored."""
    @property
    def ooms_as_recorded(self) -> int:
        """Of ``ooms``, the requests that failed when the trace was recorded too."""
    @property
    def releases(self) -> int:
        """The job's releases of cached memory the replay repeated."""
    @property
    def seconds(self) -> float:
        """Wall-clock seconds the replay took, not counting the min-capacity search."""
    @property
    def events_per_second(self) -> float:
        """Events replayed per wall-clock second."""
    @property
    def min_capacity_bytes(self) -> int | None:
        """The smallest sim capacity without an OOM (within 0.02%), if it was asked for and one
        runs the trace."""
    @property
    def min_capacity_corrected(self) -> bool:
        """Whether the bisection's answer failed its check (no OOM there, an OOM a tolerance
        below) and a search past it found ``min_capacity_bytes``."""
    @property
    def min_capacity_utilization(self) -> float | None:
        """The trace's peak live bytes over ``min_capacity_bytes``; None when that is None."""
    @property
    def timeline(self) -> tuple[list[int], list[int], list[int]]:
        """``(event_index, reserved_bytes, live_bytes)``; each point is the highest value until
        the next point's event."""
    @property
    def recorded_reserved_bytes(self) -> list[int]:
        """The recorded run's reserved bytes at the timeline's points (empty when unknown)."""
    @property
    def largest_gap_bytes(self) -> int | None:
        """The most the replay's reserved bytes differed from the recorded run's at one event."""

def replay(
    trace: Trace,
    config: str | None = None,
    capacity: int | str | None = None,
    min_capacity: bool = False,
    device: str = "sim",
    tolerance: float | None = None,
    job: str = "honour",
) -> ReplayResult:
    """Replays ``trace`` on a fresh pool; ``sim`` without a capacity is unlimited. The
    min-capacity search stops within ``tolerance`` of its answer (0.02% unless given). ``job``
    says which of the job's own actions are repeated: ``ignore``, ``honour`` (``empty_cache()``
    calls and recorded failures) or ``as_run`` (also the out-of-memory path's releases)."""

def replay_from_start(
    trace: Trace,
    config: str,
    start: list[tuple[int, int, bool, int]],
    min_capacity: bool = False,
    decisions: bool = False,
    capacity: int | None = None,
    job: str = "honour",
) -> tuple[ReplayResult, list[tuple[str, int]], int]:
    """Replays ``trace`` (plain segments only) on ``sim`` from the segments ``start``
    (``(address, size, is_small, stream)``) and its prelude blocks where they were recorded.
    Returns the result, the pool's segment decisions ``(action, size)`` (with ``decisions``) and
    how many prelude blocks no start segment held."""

def matched_in_order(recorded: list[tuple[str, int]], replayed: list[tuple[str, int]], max_edits: int) -> int | None:
    """The longest common subsequence's length; None past ``max_edits`` insertions and deletions."""

def inert_keys(config: str) -> list[str]:
    """The keys of ``config`` accepted without effect on device memory; ValueError if invalid."""

def first_block_rows(rows: list[tuple[str, int, int, int, float]]) -> list[int]:
    """The index of each address's first ``alloc`` or ``free_completed`` row, in the order the
    addresses first appear."""

def live_at_peak(
    rows: list[tuple[str, int, int, int, float]], start: list[tuple[int, int]]
) -> list[tuple[int | None, int, int]]:
    """The blocks live when the requested bytes live in ``rows`` first peaked, from the blocks
    ``start`` ``(address, size)`` live before them, as ``(row, address, size)`` (``row`` None for
    a start block), sorted by address."""
