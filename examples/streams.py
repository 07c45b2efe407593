"""Streams: a block used on a second stream is not reused until that stream's work is done.

On a simulated device (``sim``) streams are deterministic: ``stream.hold()`` keeps one busy, as
queued kernels would, until it is synchronized. A buffer is allocated on ``producer``, used on
``consumer`` (``record_stream``), and freed while ``consumer`` is still busy: the free is
deferred (the bytes stay active, not allocated), a new request gets other memory, and once
``consumer`` is synchronized the block returns to the pool and serves the next request.

    python examples/streams.py
"""

import gpupool

MiB = 1 << 20
pool = gpupool.Pool("sim", capacity="1GiB", config="strategy:pytorch")
producer, consumer = pool.stream(), pool.stream()
print(f"streams {producer.id} and {consumer.id} on {pool.device} (the default stream is {pool.default_stream.id})")


def usage(moment: str) -> None:
    stats = pool.memory_stats()
    figures = {name: stats[f"{name}_bytes.all.current"] // MiB for name in ("allocated", "active", "reserved")}
    print(f"{moment:<40}", ", ".join(f"{name} {mib:>2} MiB" for name, mib in figures.items()))


buffer = pool.alloc(12 * MiB, stream=producer)  # written by the producer's kernels
consumer.hold()  # the consumer has queued work that reads the buffer
buffer.record_stream(consumer)
first_address = buffer.ptr
usage("allocated on the producer, used on both")
buffer.free()
usage("freed while the consumer is busy")

other = pool.alloc(12 * MiB, stream=producer)
print(f"a new request got {'the same' if other.ptr == first_address else 'other'} memory")
other.free()

consumer.synchronize()  # the consumer's work is done: the deferred free completes
usage("after consumer.synchronize()")
again = pool.alloc(12 * MiB, stream=producer)
print(f"the next request got {'the freed block' if again.ptr == first_address else 'other memory'}")
again.free()
pool.synchronize()  # waits for every stream and pending event
usage("after pool.synchronize()")
