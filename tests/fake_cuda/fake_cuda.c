/* A strict fake CUDA driver (libcuda) over host memory, for testing gpupool's cuda backend without
 * a GPU. It implements the driver calls gpupool makes and enforces the rules a real driver
 * enforces, or leaves undefined, where gpupool could get them wrong:
 *   - a current context per thread (calls that need one fail without it);
 *   - per-stream queues: work runs in stream order, an event completes only when its stream
 *     reaches it, cuStreamWaitEvent adds an edge, the legacy default stream waits for (and is
 *     waited for by) blocking streams but not non-blocking ones;
 *   - work enqueued by a test (fake_cuda_launch, a "kernel") stays queued until the test finishes
 *     it (fake_cuda_complete) or a synchronizing call waits for it: that is when a stream is busy;
 *   - a race check: when queued work touches device memory, no earlier-enqueued kernel on another
 *     stream may still be pending on the same bytes, and memory may not be freed or unmapped under
 *     a pending kernel; a kernel, when it runs, checks that its range is still backed by the
 *     allocations it was given. Each breach is a violation (fake_cuda_violations);
 *   - stream capture: queries and synchronization of a capturing stream (or of its context, in
 *     any mode), and unsafe calls (synchronous allocation, copies, frees, mapping) that the
 *     calling thread's capture mode forbids (cuThreadExchangeStreamCaptureMode; in the default
 *     global mode: during its own capture or any global-mode capture), fail with
 *     CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the capture; while a blocking stream captures, the legacy stream is unusable
 *     (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT); a stream that waits for an event recorded in a
 *     capture joins it, and a capture that ends before its joined streams rejoin it (the
 *     origin stream waits for an event recorded on them after their last work) is invalid; a
 *     capturing stream's plain wait for an event recorded outside the capture is a violation,
 *     which invalidates the capture (CUDA_ERROR_STREAM_CAPTURE_ISOLATION); each capture
 *     sequence has an id (shared by the streams that joined it, cuStreamGetCaptureInfo_v2),
 *     and a capturing stream's wait for an event recorded in another capture would merge two
 *     independent captures: a violation, which invalidates both
 *     (CUDA_ERROR_STREAM_CAPTURE_MERGE); querying or synchronizing an event recorded in a
 *     capture is a violation (CUDA_ERROR_CAPTURED_EVENT), which invalidates the capture if it
 *     still runs, and so is a wait for one whose capture has ended; an invalidated capture is
 *     invalid on every stream in it;
 *   - cuMemFree does not wait for queued work (the driver documents only that it "may"): freeing
 *     memory a pending kernel uses is a violation;
 *   - cuInit before any other call, cuDriverGetVersion included; device handles distinct from
 *     ordinals; no call at all in a child forked after cuInit (CUDA does not survive a fork: the
 *     call is a violation, and fails with CUDA_ERROR_NOT_INITIALIZED);
 *   - contexts: streams and events belong to the context current when they were made (the
 *     legacy handles to whichever is current), and cuEventRecord takes an event and a stream of
 *     the same context only; a primary context lives while retained (and not reset), one made
 *     with cuCtxCreate until cuCtxDestroy, and a context that dies takes its streams and events
 *     with it (its handle, made current or current already, is an invalid context);
 *   - handles: a destroyed stream (and each of the latest 4096 destroyed events) stays allocated,
 *     so that its address goes to no new one and any later use of the dangling handle, a second
 *     destroy included, is a violation;
 *   - virtual memory: sizes and addresses aligned to the granularity the driver reports, mapping
 *     only unmapped pages, cuMemUnmap of whole mappings only, access set on fully mapped ranges,
 *     address ranges freed only when nothing in them is mapped, exports only of handles created
 *     with that handle type.
 * Nothing here is a measurement of a GPU.
 *
 * Built by the test suites (tests/fake_driver.py, tests/cuda_fake.rs) as libcuda.so(.1) and found
 * by cudarc's ordinary dynamic loading. Switches, read from the environment at each call:
 *   FAKE_CUDA_DRIVER_VERSION   what cuDriverGetVersion reports (default 13000, CUDA 13.0)
 *   FAKE_CUDA_DEVICE_COUNT     devices (default 1)
 *   FAKE_CUDA_MEMORY           bytes per device (default 1 GiB); beyond it allocations fail
 *   FAKE_CUDA_INIT_ERROR       a status cuInit returns instead of success (e.g. 100, no device)
 *   FAKE_CUDA_GRANULARITY      the mapping granularity (default 2 MiB)
 *   FAKE_CUDA_FAIL_UNMAP       fail the Nth cuMemUnmap from now on (1 = the next one)
 *   FAKE_CUDA_FAIL_EVENT_RECORD  fail the process's Nth cuEventRecord call (read at each call)
 *   FAKE_CUDA_FAIL_RELEASE     fail the process's Nth cuMemRelease (read at each call, so a test
 *                              may set it as it goes); the handle stays retained
 *   FAKE_CUDA_NO_PEER          "A:B,..." pairs of ordinals: device A cannot access device B's memory
 *   FAKE_CUDA_NO_VMM, FAKE_CUDA_NO_POSIX_FD, FAKE_CUDA_NO_MEMPOOLS   (set to 1) the device reports
 *                              no virtual memory management, no POSIX descriptor export, no
 *                              stream-ordered pool (cuDeviceGetAttribute)
 * A missing symbol is made at build time, by hiding it with a linker version script. */

#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    CUDA_ERROR_CAPTURED_EVENT = 907,
    CUDA_ERROR_UNKNOWN = 999,
};

#define MAX_DEVICES 8
#define MAX_ITEMS 4096
#define MAX_DEPS 64
#define LEGACY ((struct stream *)&legacy)
/* Device handles are not ordinals here (the driver API never promises they are): a handle passed
 * where an ordinal belongs, or the other way round, is an invalid device. */
#define DEVICE_HANDLE_BASE 0x100

/* ---- the driver's objects ----
 * Handles given out are pointers to these; every handle passed in is looked up in a registry
 * before use, so a stale or made-up handle is an error, not a crash. */

/* A primary context (`contexts`) lives while retained, and not reset since its latest retain;
 * one made with cuCtxCreate (`created_contexts`) holds one retain until it is destroyed. */
struct context { int device; int retains; int reset; };

/* An operation queued on a stream. It runs when it is at the front of its stream and every
 * dependency (stream, sequence number) has completed; a kernel also waits to be finished. */
enum op_kind { OP_MARK, OP_KERNEL, OP_COPY, OP_FREE };
struct dependency { struct stream *stream; unsigned long long seq; };
struct op {
    enum op_kind kind;
    unsigned long long order; /* global enqueue order, for the race check */
    uintptr_t address;
    size_t size;
    int held;                               /* kernels: waiting for the test or a synchronize */
    unsigned char tag;                      /* kernels: the byte they write */
    unsigned long long *backing;            /* kernels: serial of the memory under each page */
    void *host;                             /* copies: the host side */
    int to_device;
    int ndeps;
    struct dependency deps[MAX_DEPS];
    struct op *next;
};

struct context;
struct stream {
    int live;
    struct context *context;  /* current at creation */
    unsigned int flags; /* 1: non-blocking (no implicit order with the legacy stream) */
    unsigned long long enqueued, completed;
    struct op *head, *tail;
    int capturing, capture_mode, capture_invalid;
    unsigned long long capture_id; /* the capture sequence it is in, while capturing */
    pthread_t capture_thread; /* the thread that began the capture */
    struct stream *joined; /* the capture this stream joined by waiting for one of its events */
    int rejoined;          /* the origin stream waited for its latest work since */
    unsigned long long captured; /* operations captured on it so far */
};

/* `captured`: recorded in capture sequence `capture_id`, after `capture_ops` operations captured
 * on its stream. */
struct event {
    int live;
    struct context *context;
    struct stream *stream;
    unsigned long long seq;
    int captured;
    unsigned long long capture_id;
    unsigned long long capture_ops;
};
struct allocation { uintptr_t address; size_t size; int device; unsigned long long serial; };
struct physical { size_t size; int device; int mappings; int released; int retains; unsigned int handle_types; };
struct mapping { uintptr_t address; size_t size; struct physical *physical; unsigned long long serial; };
struct reservation { uintptr_t base; size_t size; unsigned char *accessible; };
struct mempool { int device; unsigned long long release_threshold; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static struct context contexts[MAX_DEVICES];
static struct context created_contexts[MAX_DEVICES];
static struct mempool mempools[MAX_DEVICES];
static size_t used[MAX_DEVICES];
static __thread struct context *current;
static struct stream legacy = {.live = 1};

static struct allocation allocations[MAX_ITEMS];
static int allocation_count;
static struct mapping mappings[MAX_ITEMS];
static int mapping_count;
static struct stream *streams[MAX_ITEMS];
static struct event *events[MAX_ITEMS];
static struct physical *physicals[MAX_ITEMS];
static struct reservation reservations[256];
/* Exported allocations, by the inode of the descriptor that stands for each. */
static struct { ino_t inode; struct physical *physical; } exports[MAX_ITEMS];
static int reservation_count;
static unsigned long long next_serial = 1, next_order = 1;
/* Capture sequence ids: unique over the process's life, as the driver's are. */
static unsigned long long next_capture_id = 1;
/* The calling thread's capture interaction mode (cuThreadExchangeStreamCaptureMode): 0 global,
 * the default; 1 thread-local; 2 relaxed. */
static __thread int capture_mode;

/* ---- switches, call counters, violations ---- */

static long long env_number(const char *name, long long fallback) {
    const char *text = getenv(name);
    return text && *text ? strtoll(text, NULL, 0) : fallback;
}

static int device_count(void) { return (int)env_number("FAKE_CUDA_DEVICE_COUNT", 1); }
static size_t device_memory(void) { return (size_t)env_number("FAKE_CUDA_MEMORY", 1LL << 30); }
static size_t granularity(void) { return (size_t)env_number("FAKE_CUDA_GRANULARITY", 2LL << 20); }

struct counter { const char *name; unsigned long long calls; };
static struct counter counters[128];

static void count(const char *name) {
    for (int i = 0; i < 128; i++) {
        if (!counters[i].name) counters[i].name = name;
        if (counters[i].name == name || strcmp(counters[i].name, name) == 0) {
            counters[i].calls++;
            return;
        }
    }
}

unsigned long long fake_cuda_calls(const char *name) {
    pthread_mutex_lock(&lock);
    unsigned long long calls = 0;
    for (int i = 0; i < 128 && counters[i].name; i++)
        if (strcmp(counters[i].name, name) == 0) calls = counters[i].calls;
    pthread_mutex_unlock(&lock);
    return calls;
}

static unsigned long long violation_count;
static char last_violation[512];

static void violation(const char *what, uintptr_t address, size_t size) {
    violation_count++;
    snprintf(last_violation, sizeof last_violation, "%s at [%#lx, %#lx)", what, (unsigned long)address,
             (unsigned long)(address + size));
    fprintf(stderr, "fake_cuda: violation: %s\n", last_violation);
}

/* How many ordering or lifetime rules were broken so far, and the latest one in words. */
unsigned long long fake_cuda_violations(void) { return violation_count; }
const char *fake_cuda_last_violation(void) { return last_violation; }

/* How many mappings exist (cuMemMap'd ranges not unmapped yet). */
unsigned long long fake_cuda_mappings(void) {
    pthread_mutex_lock(&lock);
    unsigned long long n = (unsigned long long)mapping_count;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Whether `c` is a context handle given out and not dead since. */
static int context_live(const struct context *c) {
    uintptr_t at = (uintptr_t)c;
    int primary = at >= (uintptr_t)contexts && at < (uintptr_t)(contexts + MAX_DEVICES);
    int created = at >= (uintptr_t)created_contexts && at < (uintptr_t)(created_contexts + MAX_DEVICES);
    return (primary || created) && c->retains > 0 && !c->reset;
}

/* Device memory allocated on device `ordinal` (what cuMemGetInfo counts as used): a leak check. */
unsigned long long fake_cuda_used(int ordinal) {
    pthread_mutex_lock(&lock);
    unsigned long long n = ordinal >= 0 && ordinal < MAX_DEVICES ? used[ordinal] : 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Retains held on device `ordinal`'s primary context (0: it is dead). */
int fake_cuda_primary_retains(int ordinal) {
    pthread_mutex_lock(&lock);
    int n = ordinal >= 0 && ordinal < MAX_DEVICES ? contexts[ordinal].retains : 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Set in a child forked after cuInit: the parent's driver state is not the child's. */
static int forked_after_init;
static void mark_forked(void) { forked_after_init = 1; }

/* Every driver entry point: count it, take the lock, require cuInit (and a context) first, and
 * refuse a forked child. */
#define ENTER(need_context)                                                    \
    pthread_mutex_lock(&lock);                                                 \
    count(__func__);                                                           \
    CUresult status = CUDA_SUCCESS;                                            \
    if (forked_after_init) {                                                   \
        violation("a driver call in a child forked after cuInit", 0, 0);       \
        status = CUDA_ERROR_NOT_INITIALIZED;                                   \
        goto out;                                                              \
    }                                                                          \
    if (!initialized) { status = CUDA_ERROR_NOT_INITIALIZED; goto out; }       \
    if ((need_context) && !context_live(current)) { status = CUDA_ERROR_INVALID_CONTEXT; goto out; }
#define FAIL(code) do { status = (code); goto out; } while (0)
#define LEAVE out: pthread_mutex_unlock(&lock); return status

/* ---- registries ---- */

static int add(void **table, void *item) {
    for (int i = 0; i < MAX_ITEMS; i++)
        if (!table[i]) { table[i] = item; return 1; }
    return 0;
}

static int find_in(void **table, int size, const void *item) {
    if (!item) return -1;
    for (int i = 0; i < size; i++)
        if (table[i] == item) return i;
    return -1;
}

static int find(void **table, const void *item) { return find_in(table, MAX_ITEMS, item); }

/* Destroyed streams are kept (never reused) so that a later use of one is seen: the handle is
 * dangling on a real driver, and any use of it, destroying it again included, is a violation. */
static struct stream *destroyed_streams[MAX_ITEMS];

/* Handles 0x0 and 0x1 (legacy) and 0x2 (per-thread, treated alike here) are the default stream. */
static struct stream *stream_of(void *handle) {
    if ((uintptr_t)handle <= 2) return LEGACY;
    if (find((void **)streams, handle) >= 0) return handle;
    if (find((void **)destroyed_streams, handle) >= 0) violation("use of a destroyed stream", 0, 0);
    return NULL;
}

/* Destroyed events are kept, the latest DEAD_EVENTS of them, so that their addresses are not
 * handed to new events meanwhile and a later use of one is seen: the handle is dangling on a
 * real driver, and any use of it, destroying it again included, is a violation. */
#define DEAD_EVENTS 4096
static struct event *destroyed_events[DEAD_EVENTS];
static unsigned dead_event_next;

static int live_event(struct event *e) {
    if (find((void **)events, e) >= 0) return 1;
    if (e && find_in((void **)destroyed_events, DEAD_EVENTS, e) >= 0) violation("use of a destroyed event", 0, 0);
    return 0;
}

static struct allocation *allocation_holding(uintptr_t address) {
    for (int i = 0; i < allocation_count; i++) {
        struct allocation *a = &allocations[i];
        if (a->address <= address && address < a->address + a->size) return a;
    }
    return NULL;
}

static struct mapping *mapping_holding(uintptr_t address) {
    for (int i = 0; i < mapping_count; i++) {
        struct mapping *m = &mappings[i];
        if (m->address <= address && address < m->address + m->size) return m;
    }
    return NULL;
}

static struct reservation *reservation_holding(uintptr_t address) {
    for (int i = 0; i < reservation_count; i++) {
        struct reservation *r = &reservations[i];
        if (r->base <= address && address < r->base + r->size) return r;
    }
    return NULL;
}

/* The serial of the memory behind `address` (0: none, or not accessible). */
static unsigned long long serial_at(uintptr_t address) {
    struct allocation *a = allocation_holding(address);
    if (a) return a->serial;
    struct mapping *m = mapping_holding(address);
    struct reservation *r = reservation_holding(address);
    if (!m || !r || !r->accessible[(address - r->base) / granularity()]) return 0;
    return m->serial;
}

/* Whether [address, address + size) is device memory that may be touched, page by page. */
static int range_ok(uintptr_t address, size_t size) {
    if (size == 0) return 0;
    struct allocation *a = allocation_holding(address);
    if (a) return address + size <= a->address + a->size;
    for (uintptr_t p = address; p < address + size; p = (p / granularity() + 1) * granularity())
        if (!serial_at(p)) return 0;
    return 1;
}

static CUresult reserve_memory(int device, size_t size) {
    if (used[device] + size > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
    used[device] += size;
    return CUDA_SUCCESS;
}

/* ---- stream queues ---- */

static int overlaps(const struct op *op, uintptr_t address, size_t size) {
    return op->size && op->address < address + size && address < op->address + op->size;
}

/* A pending kernel (on any stream but `self`) enqueued before `order` that touches the range. */
static int kernel_pending_on(uintptr_t address, size_t size, unsigned long long order, struct stream *self) {
    struct stream *all[MAX_ITEMS + 1];
    int n = 0;
    all[n++] = LEGACY;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i]) all[n++] = streams[i];
    for (int i = 0; i < n; i++) {
        if (all[i] == self) continue;
        for (struct op *op = all[i]->head; op; op = op->next)
            if (op->kind == OP_KERNEL && op->order < order && overlaps(op, address, size)) return 1;
    }
    return 0;
}

static int deps_done(const struct op *op) {
    for (int i = 0; i < op->ndeps; i++)
        if (op->deps[i].stream->completed < op->deps[i].seq) return 0;
    return 1;
}

static CUresult release_range(uintptr_t address);
static void destroy_context(struct context *c);

/* Runs the front operation of `s` (which must be runnable). */
static void run_front(struct stream *s) {
    struct op *op = s->head;
    if (op->size && kernel_pending_on(op->address, op->size, op->order, s))
        violation("work ran while an earlier kernel on another stream still used the bytes", op->address, op->size);
    switch (op->kind) {
    case OP_KERNEL: {
        size_t g = granularity();
        for (uintptr_t p = op->address, i = 0; p < op->address + op->size; p = (p / g + 1) * g, i++)
            if (serial_at(p) != op->backing[i]) {
                violation("a kernel ran on memory no longer backed by the allocation it was given", op->address,
                          op->size);
                goto done;
            }
        memset((void *)op->address, op->tag, op->size);
        break;
    }
    case OP_COPY:
        if (!range_ok(op->address, op->size)) violation("a copy ran on unbacked memory", op->address, op->size);
        else if (op->to_device) memcpy((void *)op->address, op->host, op->size);
        else memcpy(op->host, (void *)op->address, op->size);
        break;
    case OP_FREE: release_range(op->address); break;
    case OP_MARK: break;
    }
done:
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    s->completed++;
    free(op->backing);
    free(op);
}

/* Runs whatever can run without anyone waiting: everything but kernels not yet finished. */
static void advance(void) {
    for (int progress = 1; progress;) {
        progress = 0;
        struct stream *s = LEGACY;
        for (int i = -1; i < MAX_ITEMS; i++, s = i < MAX_ITEMS ? streams[i] : NULL) {
            while (s && s->head && !(s->head->kind == OP_KERNEL && s->head->held) && deps_done(s->head)) {
                run_front(s);
                progress = 1;
            }
        }
    }
}

/* Blocks (in fake time) until `s` has completed `seq` operations: finishes whatever is in the way. */
static void run_until(struct stream *s, unsigned long long seq) {
    while (s->completed < seq) {
        struct op *op = s->head;
        if (!deps_done(op)) {
            for (int i = 0; i < op->ndeps; i++) run_until(op->deps[i].stream, op->deps[i].seq);
            continue; /* running a dependency advances every stream: `op` may have run (and gone) */
        }
        op->held = 0;
        run_front(s);
    }
    advance();
}

static void add_dependency(struct op *op, struct stream *s, unsigned long long seq) {
    if (op->ndeps < MAX_DEPS && s->completed < seq) op->deps[op->ndeps++] = (struct dependency){s, seq};
}

/* Queues `op` on `s`, with the legacy stream's implicit ordering; returns its sequence number.
 * On a capturing stream the work goes into the graph instead, and never runs here. */
static unsigned long long enqueue(struct stream *s, struct op *op) {
    if (s->capturing) {
        s->captured++;
        free(op->backing);
        free(op);
        return 0;
    }
    op->order = next_order++;
    if (s == LEGACY) {
        for (int i = 0; i < MAX_ITEMS; i++)
            if (streams[i] && !(streams[i]->flags & 1)) add_dependency(op, streams[i], streams[i]->enqueued);
    } else if (!(s->flags & 1)) {
        add_dependency(op, LEGACY, LEGACY->enqueued);
    }
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    s->enqueued++;
    return s->enqueued;
}

static struct op *new_op(enum op_kind kind, uintptr_t address, size_t size) {
    struct op *op = calloc(1, sizeof *op);
    op->kind = kind;
    op->address = address;
    op->size = size;
    return op;
}

/* Whether capture sequence `id` is still running on some stream. */
static int capture_running(unsigned long long id) {
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i] && streams[i]->capturing && streams[i]->capture_id == id) return 1;
    return 0;
}

/* Invalidates the capture `s` is in, on every stream in it: the origin's end fails, and each
 * stream reports the capture invalidated. */
static void invalidate_capture(struct stream *s) {
    if (!s->capturing) return;
    s->capture_invalid = 1;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i] && streams[i]->capturing && streams[i]->capture_id == s->capture_id)
            streams[i]->capture_invalid = 1;
}

/* Whether the calling thread is prohibited from "potentially unsafe" calls, by its mode: in
 * global mode by a capture of its own not begun relaxed or by any thread's global-mode capture,
 * in thread-local mode by its own only, in relaxed mode never. Those captures are invalidated.
 * (Streams that joined a capture are counted through the stream that began it.) */
static int capture_forbids_unsafe_calls(void) {
    int forbidden = 0;
    for (int i = 0; i < MAX_ITEMS && capture_mode != 2; i++) {
        struct stream *s = streams[i];
        if (!s || !s->capturing || s->joined) continue;
        int own = pthread_equal(s->capture_thread, pthread_self()) && s->capture_mode != 2;
        if (own || (capture_mode == 0 && s->capture_mode == 0)) {
            invalidate_capture(s);
            forbidden = 1;
        }
    }
    return forbidden;
}

/* While a blocking stream captures, the legacy stream is unusable: asking about it fails, and
 * work queued on it (`use`) also invalidates those captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). */
static int legacy_unusable(struct stream *s, int use) {
    if (s != LEGACY) return 0;
    int blocked = 0;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i] && streams[i]->capturing && !(streams[i]->flags & 1)) {
            if (use) invalidate_capture(streams[i]);
            blocked = 1;
        }
    return blocked;
}

/* ---- test controls ---- */

/* Queues a kernel on `stream` that writes `tag` over [address, address + size) when it runs. It
 * runs only once fake_cuda_complete finishes it or a synchronizing call waits for it; then it
 * checks that the range is still backed by the memory it was launched on. */
CUresult fake_cuda_launch(void *stream, CUdeviceptr address, size_t size, unsigned char tag) {
    ENTER(1);
    struct stream *s = stream_of(stream);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (!range_ok(address, size)) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct op *op = new_op(OP_KERNEL, address, size);
    op->held = 1;
    op->tag = tag;
    size_t g = granularity(), pages = size / g + 2, i = 0;
    op->backing = calloc(pages, sizeof *op->backing);
    for (uintptr_t p = address; p < address + size; p = (p / g + 1) * g) op->backing[i++] = serial_at(p);
    enqueue(s, op);
    LEAVE;
}

/* Finishes every kernel queued on `stream` so far (and whatever then can run). */
CUresult fake_cuda_complete(void *stream) {
    ENTER(0);
    struct stream *s = stream_of(stream);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    for (struct op *op = s->head; op; op = op->next) op->held = 0;
    advance();
    LEAVE;
}

/* Operations queued on `stream` that have not run. */
unsigned long long fake_cuda_pending(void *stream) {
    pthread_mutex_lock(&lock);
    struct stream *s = stream_of(stream);
    unsigned long long pending = s ? s->enqueued - s->completed : 0;
    pthread_mutex_unlock(&lock);
    return pending;
}

/* ---- initialization, devices, contexts ---- */

CUresult cuDriverGetVersion(int *version) {
    ENTER(0);
    if (!version) FAIL(CUDA_ERROR_INVALID_VALUE);
    *version = (int)env_number("FAKE_CUDA_DRIVER_VERSION", 13000);
    LEAVE;
}

CUresult cuInit(unsigned int flags) {
    pthread_mutex_lock(&lock);
    count(__func__);
    CUresult status = (CUresult)env_number("FAKE_CUDA_INIT_ERROR", 0);
    if (flags != 0) status = CUDA_ERROR_INVALID_VALUE;
    if (forked_after_init) {
        violation("cuInit in a child forked after cuInit", 0, 0);
        status = CUDA_ERROR_NOT_INITIALIZED;
    }
    if (status == CUDA_SUCCESS && !initialized) pthread_atfork(NULL, NULL, mark_forked);
    if (status == CUDA_SUCCESS) initialized = 1;
    pthread_mutex_unlock(&lock);
    return status;
}

CUresult cuDeviceGetCount(int *n) {
    ENTER(0);
    if (!n) FAIL(CUDA_ERROR_INVALID_VALUE);
    *n = device_count();
    LEAVE;
}

/* Whether `ordinal` names a device (memory locations take ordinals). */
static int device_ok(int ordinal) { return ordinal >= 0 && ordinal < device_count() && ordinal < MAX_DEVICES; }

/* The ordinal of device handle `device`, or -1 when it is not one cuDeviceGet gives out. */
static int ordinal_of(CUdevice device) {
    return device_ok(device - DEVICE_HANDLE_BASE) ? device - DEVICE_HANDLE_BASE : -1;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER(0);
    if (!device) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!device_ok(ordinal)) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal + DEVICE_HANDLE_BASE;
    LEAVE;
}

/* Whether FAKE_CUDA_NO_PEER lists "from:to". */
static int peer_refused(int from, int to) {
    const char *list = getenv("FAKE_CUDA_NO_PEER");
    for (const char *at = list; at && *at;) {
        int a, b, used;
        if (sscanf(at, "%d:%d%n", &a, &b, &used) != 2) break;
        if (a == from && b == to) return 1;
        at += used;
        if (*at == ',') at++;
    }
    return 0;
}

/* Whether contexts on `device` can access memory on `peer` (device handles both). */
CUresult cuDeviceCanAccessPeer(int *can, CUdevice device, CUdevice peer) {
    ENTER(0);
    int from = ordinal_of(device), to = ordinal_of(peer);
    if (!can) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (from < 0 || to < 0) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *can = from != to && !peer_refused(from, to);
    LEAVE;
}

/* The three yes/no attributes gpupool asks about; the others are not modelled. */
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    ENTER(0);
    if (!value) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (ordinal_of(device) < 0) FAIL(CUDA_ERROR_INVALID_DEVICE);
    switch (attribute) {
    case 102: *value = !env_number("FAKE_CUDA_NO_VMM", 0); break;      /* virtual memory management */
    case 103: *value = !env_number("FAKE_CUDA_NO_POSIX_FD", 0); break; /* POSIX descriptor export */
    case 115: *value = !env_number("FAKE_CUDA_NO_MEMPOOLS", 0); break; /* stream-ordered pools */
    default: FAIL(CUDA_ERROR_INVALID_VALUE);
    }
    LEAVE;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice device) {
    ENTER(0);
    int ordinal = ordinal_of(device);
    if (!ctx) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0) FAIL(CUDA_ERROR_INVALID_DEVICE);
    contexts[ordinal].device = ordinal;
    contexts[ordinal].retains++;
    contexts[ordinal].reset = 0;
    *ctx = &contexts[ordinal];
    LEAVE;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    ENTER(0);
    int ordinal = ordinal_of(device);
    if (ordinal < 0) FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (contexts[ordinal].retains == 0) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    if (--contexts[ordinal].retains == 0) destroy_context(&contexts[ordinal]);
    LEAVE;
}

/* cudaDeviceReset: the primary context dies whoever retains it (the retains stay, to be
 * released); the next retain makes it anew. */
CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) {
    ENTER(0);
    int ordinal = ordinal_of(device);
    if (ordinal < 0) FAIL(CUDA_ERROR_INVALID_DEVICE);
    destroy_context(&contexts[ordinal]);
    contexts[ordinal].reset = 1;
    LEAVE;
}

/* A context of its own (not the primary one), made current on the calling thread. */
CUresult cuCtxCreate_v2(void **ctx, unsigned int flags, CUdevice device) {
    ENTER(0);
    int ordinal = ordinal_of(device);
    if (!ctx || flags != 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0) FAIL(CUDA_ERROR_INVALID_DEVICE);
    struct context *c = NULL;
    for (int i = 0; i < MAX_DEVICES && !c; i++)
        if (created_contexts[i].retains == 0) c = &created_contexts[i];
    if (!c) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    *c = (struct context){ordinal, 1, 0};
    current = c;
    *ctx = c;
    LEAVE;
}

CUresult cuCtxDestroy_v2(void *ctx) {
    ENTER(0);
    struct context *c = ctx;
    uintptr_t at = (uintptr_t)c;
    if (at < (uintptr_t)created_contexts || at >= (uintptr_t)(created_contexts + MAX_DEVICES) || !context_live(c))
        FAIL(CUDA_ERROR_INVALID_CONTEXT);
    destroy_context(c);
    c->retains = 0;
    if (current == c) current = NULL;
    LEAVE;
}

/* The device of the current context. */
CUresult cuCtxGetDevice(CUdevice *device) {
    ENTER(1);
    if (!device) FAIL(CUDA_ERROR_INVALID_VALUE);
    *device = current->device + DEVICE_HANDLE_BASE;
    LEAVE;
}

CUresult cuCtxGetCurrent(void **ctx) {
    ENTER(0);
    if (!ctx) FAIL(CUDA_ERROR_INVALID_VALUE);
    *ctx = current;
    LEAVE;
}

CUresult cuCtxSetCurrent(void *ctx) {
    ENTER(0);
    struct context *c = ctx;
    if (c && !context_live(c)) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    current = c;
    LEAVE;
}

/* The current context's work (the legacy stream, shared here, counts as every context's). */
static void synchronize_all(void) {
    run_until(LEGACY, LEGACY->enqueued);
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i] && streams[i]->context == current) run_until(streams[i], streams[i]->enqueued);
}

CUresult cuCtxSynchronize(void) {
    ENTER(1);
    if (capture_forbids_unsafe_calls()) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    /* Synchronizing a context while any of its streams captures is invalid in every mode. */
    int capturing = 0;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i] && streams[i]->capturing && streams[i]->context == current) {
            invalidate_capture(streams[i]);
            capturing = 1;
        }
    if (capturing) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    synchronize_all();
    LEAVE;
}

/* ---- memory ---- */

static CUresult allocate(CUdeviceptr *out, size_t size) {
    if (!out || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (allocation_count == MAX_ITEMS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult status = reserve_memory(current->device, size);
    if (status != CUDA_SUCCESS) return status;
    void *memory = NULL;
    if (posix_memalign(&memory, 4096, size) != 0) {
        used[current->device] -= size;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    allocations[allocation_count++] = (struct allocation){(uintptr_t)memory, size, current->device, next_serial++};
    *out = (CUdeviceptr)(uintptr_t)memory;
    return CUDA_SUCCESS;
}

static CUresult release_range(uintptr_t address) {
    struct allocation *a = allocation_holding(address);
    if (!a || a->address != address) return CUDA_ERROR_INVALID_VALUE;
    used[a->device] -= a->size;
    free((void *)a->address);
    *a = allocations[--allocation_count];
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size) {
    ENTER(1);
    if (capture_forbids_unsafe_calls()) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    status = allocate(out, size);
    LEAVE;
}

CUresult cuMemFree_v2(CUdeviceptr address) {
    ENTER(1);
    if (capture_forbids_unsafe_calls()) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    /* Documented only as "may perform implicit synchronization": the fake does not wait, and
     * freeing memory that queued work still uses is a violation. */
    struct allocation *a = allocation_holding(address);
    if (a && kernel_pending_on(a->address, a->size, next_order, NULL))
        violation("cuMemFree of memory a pending kernel uses", a->address, a->size);
    status = release_range(address);
    LEAVE;
}

/* Stream-ordered allocation: the memory exists at once (usable in stream order); a stream-ordered
 * free returns it when the stream reaches the free. */
CUresult cuMemAllocAsync(CUdeviceptr *out, size_t size, void *stream) {
    ENTER(1);
    struct stream *s = stream_of(stream);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (legacy_unusable(s, 1)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    status = allocate(out, size);
    LEAVE;
}

CUresult cuMemFreeAsync(CUdeviceptr address, void *stream) {
    ENTER(1);
    struct stream *s = stream_of(stream);
    struct allocation *a = allocation_holding(address);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (legacy_unusable(s, 1)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    if (!a || a->address != address) FAIL(CUDA_ERROR_INVALID_VALUE);
    enqueue(s, new_op(OP_FREE, address, a->size));
    advance();
    LEAVE;
}

CUresult cuDeviceGetDefaultMemPool(struct mempool **pool, CUdevice device) {
    ENTER(0);
    int ordinal = ordinal_of(device);
    if (!pool) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0) FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (env_number("FAKE_CUDA_NO_MEMPOOLS", 0)) FAIL(CUDA_ERROR_NOT_SUPPORTED);
    mempools[ordinal].device = ordinal;
    *pool = &mempools[ordinal];
    LEAVE;
}

static int mempool_ok(struct mempool *pool) { return pool >= mempools && pool < mempools + MAX_DEVICES; }

/* Only CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (4) is modelled. */
CUresult cuMemPoolSetAttribute(struct mempool *pool, int attribute, void *value) {
    ENTER(0);
    if (!mempool_ok(pool) || attribute != 4 || !value) FAIL(CUDA_ERROR_INVALID_VALUE);
    pool->release_threshold = *(unsigned long long *)value;
    LEAVE;
}

CUresult cuMemPoolGetAttribute(struct mempool *pool, int attribute, void *value) {
    ENTER(0);
    if (!mempool_ok(pool) || attribute != 4 || !value) FAIL(CUDA_ERROR_INVALID_VALUE);
    *(unsigned long long *)value = pool->release_threshold;
    LEAVE;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ENTER(1);
    if (!free_bytes || !total) FAIL(CUDA_ERROR_INVALID_VALUE);
    *total = device_memory();
    *free_bytes = *total - used[current->device];
    LEAVE;
}

/* Synchronous copies run on the legacy stream: after blocking streams' work, not non-blocking. */
static CUresult copy_now(uintptr_t device, void *host, size_t size, int to_device) {
    if (!host || !range_ok(device, size)) return CUDA_ERROR_INVALID_VALUE;
    if (capture_forbids_unsafe_calls()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct op *op = new_op(OP_COPY, device, size);
    op->host = host;
    op->to_device = to_device;
    run_until(LEGACY, enqueue(LEGACY, op));
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t size) {
    ENTER(1);
    status = copy_now(dst, (void *)src, size, 1);
    LEAVE;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size) {
    ENTER(1);
    status = copy_now(src, dst, size, 0);
    LEAVE;
}

static CUresult copy_async(uintptr_t device, void *host, size_t size, int to_device, void *stream) {
    struct stream *s = stream_of(stream);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    if (legacy_unusable(s, 1)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    if (!host || !range_ok(device, size)) return CUDA_ERROR_INVALID_VALUE;
    struct op *op = new_op(OP_COPY, device, size);
    op->host = host;
    op->to_device = to_device;
    enqueue(s, op);
    advance();
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t size, void *stream) {
    ENTER(1);
    status = copy_async(dst, (void *)src, size, 1, stream);
    LEAVE;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t size, void *stream) {
    ENTER(1);
    status = copy_async(src, dst, size, 0, stream);
    LEAVE;
}

/* The handle another process opens with cuIpcOpenMemHandle: here, the allocation's address. */
CUresult cuIpcGetMemHandle(unsigned char handle[64], CUdeviceptr address) {
    ENTER(1);
    struct allocation *a = allocation_holding(address);
    if (!handle || !a || a->address != address) FAIL(CUDA_ERROR_INVALID_VALUE);
    memset(handle, 0, 64);
    memcpy(handle, "fakeipc", 7);
    memcpy(handle + 8, &a->address, sizeof a->address);
    LEAVE;
}

/* ---- streams and events ---- */

CUresult cuStreamCreate(struct stream **out, unsigned int flags) {
    ENTER(1);
    if (!out || flags > 1) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct stream *s = calloc(1, sizeof *s);
    if (!s || !add((void **)streams, s)) { free(s); FAIL(CUDA_ERROR_OUT_OF_MEMORY); }
    s->live = 1;
    s->context = current;
    s->flags = flags;
    *out = s;
    LEAVE;
}

/* Drops every dependency on `s`, which has completed everything queued on it. */
static void forget_dependencies_on(struct stream *s) {
    struct stream *all[MAX_ITEMS + 1] = {LEGACY};
    int n = 1;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i]) all[n++] = streams[i];
    for (int i = 0; i < n; i++)
        for (struct op *op = all[i]->head; op; op = op->next)
            for (int d = 0; d < op->ndeps;)
                if (op->deps[d].stream == s) op->deps[d] = op->deps[--op->ndeps];
                else d++;
}

/* As the driver does, a destroyed stream's queued work still runs (here: at once). */
static void destroy_stream(int i) {
    struct stream *s = streams[i];
    run_until(s, s->enqueued);
    forget_dependencies_on(s);
    streams[i] = NULL;
    for (int e = 0; e < MAX_ITEMS; e++)
        if (events[e] && events[e]->stream == s) events[e]->stream = NULL;
    s->live = 0;
    if (!add((void **)destroyed_streams, s)) free(s);
}

CUresult cuStreamDestroy_v2(struct stream *s) {
    ENTER(1);
    int i = find((void **)streams, s);
    if (i < 0) {
        stream_of(s); /* a second destruction counts as a use of a destroyed stream */
        FAIL(CUDA_ERROR_INVALID_HANDLE);
    }
    destroy_stream(i);
    LEAVE;
}

/* A context dying (its last primary retain released, a reset, or cuCtxDestroy): its work
 * finishes, and its streams and events are destroyed; later uses of their handles are errors. */
static void destroy_context(struct context *c) {
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i] && streams[i]->context == c) destroy_stream(i);
    for (int i = 0; i < MAX_ITEMS; i++)
        if (events[i] && events[i]->context == c) {
            free(events[i]);
            events[i] = NULL;
        }
}

CUresult cuStreamQuery(void *handle) {
    ENTER(1);
    struct stream *s = stream_of(handle);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (legacy_unusable(s, 1)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    if (s->capturing) { invalidate_capture(s); FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); }
    advance();
    if (s->completed < s->enqueued) FAIL(CUDA_ERROR_NOT_READY);
    LEAVE;
}

CUresult cuStreamSynchronize(void *handle) {
    ENTER(1);
    struct stream *s = stream_of(handle);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (legacy_unusable(s, 1)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    if (s->capturing) { invalidate_capture(s); FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); }
    run_until(s, s->enqueued);
    LEAVE;
}

CUresult cuStreamWaitEvent(void *handle, struct event *e, unsigned int flags) {
    ENTER(1);
    struct stream *s = stream_of(handle);
    if (!s || !live_event(e)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (flags != 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (legacy_unusable(s, 1)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    /* The legacy stream cannot join a capture: that is the disallowed implicit dependency on a
     * capture sequence from the legacy stream. */
    if (e->captured && e->stream && s == LEGACY) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    /* An event recorded in a capture that has ended stands for a node of a finished graph: no
     * stream can wait for it any more. */
    if (e->captured && e->stream && !capture_running(e->capture_id)) {
        violation("a wait for an event recorded in a capture that has ended", 0, 0);
        FAIL(CUDA_ERROR_CAPTURED_EVENT);
    }
    /* Waiting for an event recorded in a capture joins that capture: the stream's later work
     * goes into the graph, and the capture cannot end until the stream joins back. */
    if (e->captured && e->stream && !s->capturing) {
        s->capturing = 1;
        s->capture_id = e->capture_id;
        s->capture_invalid = e->stream->capture_invalid;
        s->joined = e->stream->joined ? e->stream->joined : e->stream;
        s->rejoined = 0;
        FAIL(CUDA_SUCCESS);
    }
    /* A capturing stream may wait only for work of its own capture: an event recorded outside
     * it would need CU_EVENT_WAIT_EXTERNAL (an external event node), and this fake, like the
     * programming guide, takes a plain wait on it as invalid. */
    if (s->capturing && e->stream && !e->captured) {
        violation("a capturing stream waited for an event recorded outside its capture", 0, 0);
        invalidate_capture(s);
        FAIL(CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    }
    /* Nor for an event recorded in another capture sequence: the wait would merge two
     * independent captures, and the driver invalidates both. */
    if (s->capturing && e->captured && e->stream && e->capture_id != s->capture_id) {
        violation("a capturing stream waited for an event of another capture", 0, 0);
        invalidate_capture(s);
        invalidate_capture(e->stream);
        FAIL(CUDA_ERROR_STREAM_CAPTURE_MERGE);
    }
    /* The origin stream waiting for a joined stream's latest captured work joins it back. */
    if (e->captured && e->stream && e->stream->joined == s && e->capture_ops == e->stream->captured)
        e->stream->rejoined = 1;
    struct op *op = new_op(OP_MARK, 0, 0);
    if (e->stream) add_dependency(op, e->stream, e->seq);
    enqueue(s, op);
    advance();
    LEAVE;
}

/* cudaStreamBeginCapture: mode 0 is global (the default), 1 thread-local, 2 relaxed. */
CUresult cuStreamBeginCapture_v2(void *handle, int mode) {
    ENTER(1);
    struct stream *s = stream_of(handle);
    if (!s || s == LEGACY) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (s->capturing || mode < 0 || mode > 2) FAIL(CUDA_ERROR_INVALID_VALUE);
    s->capturing = 1;
    s->capture_invalid = 0;
    s->capture_id = next_capture_id++;
    s->capture_mode = mode;
    s->capture_thread = pthread_self();
    LEAVE;
}

/* Sets the calling thread's capture interaction mode, handing back the one it replaces. */
CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    ENTER(0);
    if (!mode || *mode < 0 || *mode > 2) FAIL(CUDA_ERROR_INVALID_VALUE);
    int previous = capture_mode;
    capture_mode = *mode;
    *mode = previous;
    LEAVE;
}

/* Ends a capture; the "graph" is the stream handle (enough for tests: cuGraphDestroy is not needed). */
CUresult cuStreamEndCapture(void *handle, void **graph) {
    ENTER(1);
    struct stream *s = stream_of(handle);
    if (!s || !graph) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!s->capturing) FAIL(CUDA_ERROR_INVALID_VALUE);
    s->capturing = 0;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (streams[i] && streams[i]->joined == s) {
            if (!streams[i]->rejoined) s->capture_invalid = 1; /* never joined back: an invalid graph */
            streams[i]->capturing = 0;
            streams[i]->joined = NULL;
            streams[i]->rejoined = 0;
        }
    *graph = s->capture_invalid ? NULL : handle;
    if (s->capture_invalid) FAIL(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    LEAVE;
}

/* The context a stream belongs to; the legacy handles name the current context's. */
CUresult cuStreamGetCtx(void *handle, void **ctx) {
    ENTER(0);
    struct stream *s = stream_of(handle);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (!ctx) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (s == LEGACY && !current) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    *ctx = s == LEGACY ? current : s->context;
    LEAVE;
}

/* Status: 0 none, 1 active, 2 invalidated. */
CUresult cuStreamIsCapturing(void *handle, int *capture_status) {
    ENTER(1);
    struct stream *s = stream_of(handle);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (!capture_status) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (legacy_unusable(s, 0)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    *capture_status = s->capturing ? (s->capture_invalid ? 2 : 1) : 0;
    LEAVE;
}

/* As cuStreamIsCapturing, and, for an active capture only (the driver defines nothing else then),
 * the sequence's id and graph (the origin stream's handle, as cuStreamEndCapture gives it); the
 * fake keeps no graph nodes, so the dependency set is empty. The status is required, the rest
 * optional. */
CUresult cuStreamGetCaptureInfo_v2(void *handle, int *capture_status, unsigned long long *id, void **graph,
                                   const void ***dependencies, size_t *dependency_count) {
    ENTER(1);
    struct stream *s = stream_of(handle);
    if (!s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (!capture_status) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (legacy_unusable(s, 0)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    *capture_status = s->capturing ? (s->capture_invalid ? 2 : 1) : 0;
    if (*capture_status != 1) FAIL(CUDA_SUCCESS);
    if (id) *id = s->capture_id;
    if (graph) *graph = s->joined ? s->joined : s;
    if (dependencies) *dependencies = NULL;
    if (dependency_count) *dependency_count = 0;
    LEAVE;
}

CUresult cuEventCreate(struct event **out, unsigned int flags) {
    ENTER(1);
    if (!out || flags > 15) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct event *e = calloc(1, sizeof *e);
    if (!e || !add((void **)events, e)) { free(e); FAIL(CUDA_ERROR_OUT_OF_MEMORY); }
    e->live = 1;
    e->context = current;
    *out = e;
    LEAVE;
}

/* An event records the current end of a stream's queue; on a capturing stream it becomes a graph
 * node that cannot be queried or waited for from the host. */
static unsigned long long event_records;

CUresult cuEventRecord(struct event *e, void *handle) {
    ENTER(1);
    if (++event_records == (unsigned long long)env_number("FAKE_CUDA_FAIL_EVENT_RECORD", 0)) FAIL(CUDA_ERROR_UNKNOWN);
    struct stream *s = stream_of(handle);
    if (!live_event(e) || !s) FAIL(CUDA_ERROR_INVALID_HANDLE);
    /* "event and stream must be on the same context"; the legacy handles mean the current one's. */
    if (e->context != (s == LEGACY ? current : s->context)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (legacy_unusable(s, 1)) FAIL(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    e->captured = s->capturing;
    e->capture_id = s->capture_id;
    e->capture_ops = s->captured;
    e->stream = s;
    e->seq = s->capturing ? 0 : enqueue(s, new_op(OP_MARK, 0, 0));
    advance();
    LEAVE;
}

/* A query or synchronize of an event last recorded in a capture: the driver refuses it
 * (CUDA_ERROR_CAPTURED_EVENT), and this fake takes it as breaking a capture still running. */
static CUresult captured_event(struct event *e) {
    violation("a query or synchronize of an event recorded in a capture", 0, 0);
    if (e->stream) invalidate_capture(e->stream);
    return CUDA_ERROR_CAPTURED_EVENT;
}

CUresult cuEventQuery(struct event *e) {
    ENTER(1);
    if (!live_event(e)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (e->captured) FAIL(captured_event(e));
    advance();
    if (e->stream && e->stream->completed < e->seq) FAIL(CUDA_ERROR_NOT_READY);
    LEAVE;
}

CUresult cuEventSynchronize(struct event *e) {
    ENTER(1);
    if (!live_event(e)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (e->captured) FAIL(captured_event(e));
    if (e->stream) run_until(e->stream, e->seq);
    LEAVE;
}

CUresult cuEventDestroy_v2(struct event *e) {
    ENTER(1);
    if (!live_event(e)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    events[find((void **)events, e)] = NULL;
    free(destroyed_events[dead_event_next]);
    destroyed_events[dead_event_next] = e;
    dead_event_next = (dead_event_next + 1) % DEAD_EVENTS;
    LEAVE;
}

/* ---- virtual memory management ---- */

struct location { unsigned int type; int id; };
struct allocation_prop {
    unsigned int type;
    unsigned int handle_types;
    struct location location;
    void *win32;
    unsigned char flags[8];
};
struct access_desc { struct location location; unsigned int flags; };

static int prop_ok(const struct allocation_prop *prop) {
    return prop && prop->type == 1 /* pinned */ && prop->location.type == 1 /* device */ &&
           device_ok(prop->location.id) && prop->handle_types <= 1 /* none or POSIX fd */;
}

static int aligned(uintptr_t value) { return value % granularity() == 0; }

CUresult cuMemGetAllocationGranularity(size_t *out, const struct allocation_prop *prop, int option) {
    ENTER(0);
    if (!out || !prop_ok(prop) || option < 0 || option > 1) FAIL(CUDA_ERROR_INVALID_VALUE);
    *out = granularity();
    LEAVE;
}

CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t alignment, CUdeviceptr hint,
                             unsigned long long flags) {
    ENTER(1);
    (void)hint;
    size_t g = granularity();
    if (!out || size == 0 || !aligned(size) || !aligned(alignment) || flags) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (reservation_count == 256) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    /* Over-reserve by one granule so the base can be aligned, as the driver's are. */
    unsigned char *raw = mmap(NULL, size + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t base = ((uintptr_t)raw + g - 1) / g * g;
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    munmap((void *)(base + size), (uintptr_t)raw + g - base);
    reservations[reservation_count++] = (struct reservation){base, size, calloc(size / g, 1)};
    *out = base;
    LEAVE;
}

static int mapped_within(uintptr_t address, size_t size) {
    for (int i = 0; i < mapping_count; i++)
        if (mappings[i].address < address + size && address < mappings[i].address + mappings[i].size) return 1;
    return 0;
}

CUresult cuMemAddressFree(CUdeviceptr base, size_t size) {
    ENTER(1);
    struct reservation *r = reservation_holding((uintptr_t)base);
    if (!r || r->base != base || r->size != size) FAIL(CUDA_ERROR_INVALID_VALUE);
    /* Freeing a range that still has mappings breaks the rule even when the caller ignores the
     * error (as teardown does): count it. */
    if (mapped_within(base, size)) {
        violation("cuMemAddressFree of a range with mappings in it", base, size);
        FAIL(CUDA_ERROR_INVALID_VALUE);
    }
    munmap((void *)r->base, r->size);
    free(r->accessible);
    *r = reservations[--reservation_count];
    LEAVE;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const struct allocation_prop *prop,
                     unsigned long long flags) {
    ENTER(1);
    if (capture_forbids_unsafe_calls()) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    if (!out || size == 0 || !aligned(size) || !prop_ok(prop) || flags) FAIL(CUDA_ERROR_INVALID_VALUE);
    status = reserve_memory(prop->location.id, size);
    if (status != CUDA_SUCCESS) goto out;
    struct physical *p = calloc(1, sizeof *p);
    if (!p || !add((void **)physicals, p)) { free(p); used[prop->location.id] -= size; FAIL(CUDA_ERROR_OUT_OF_MEMORY); }
    *p = (struct physical){size, prop->location.id, 0, 0, 1, prop->handle_types};
    *out = (CUmemGenericAllocationHandle)(uintptr_t)p;
    LEAVE;
}

/* Physical memory is freed once every handle reference is released and every mapping unmapped. */
static void maybe_destroy(struct physical *p) {
    if (p->retains > 0 || p->mappings > 0) return;
    used[p->device] -= p->size;
    physicals[find((void **)physicals, p)] = NULL;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (exports[i].physical == p) exports[i].physical = NULL;
    free(p);
}

static struct physical *physical_of(CUmemGenericAllocationHandle handle) {
    struct physical *p = (struct physical *)(uintptr_t)handle;
    return find((void **)physicals, p) >= 0 && p->retains > 0 ? p : NULL;
}

static unsigned long long releases;

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER(0);
    struct physical *p = physical_of(handle);
    if (!p) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (++releases == (unsigned long long)env_number("FAKE_CUDA_FAIL_RELEASE", 0)) FAIL(CUDA_ERROR_INVALID_VALUE);
    p->retains--;
    maybe_destroy(p);
    LEAVE;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *out, void *address) {
    ENTER(0);
    struct mapping *m = mapping_holding((uintptr_t)address);
    if (!out || !m) FAIL(CUDA_ERROR_INVALID_VALUE);
    m->physical->retains++;
    *out = (CUmemGenericAllocationHandle)(uintptr_t)m->physical;
    LEAVE;
}

/* Handle type 1 is CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR. An export is a fresh memfd whose inode
 * stands for the physical allocation; an import (in this process: the fake's memory is its own)
 * finds the allocation again by the inode of the descriptor it is given. */

CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags) {
    ENTER(0);
    struct physical *p = physical_of(handle);
    if (!shareable || !p || type != 1 || flags || !(p->handle_types & 1)) FAIL(CUDA_ERROR_INVALID_VALUE);
    int fd = memfd_create("fake_cuda_export", MFD_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    for (int i = 0; i < MAX_ITEMS; i++)
        if (!exports[i].physical) {
            exports[i].inode = st.st_ino;
            exports[i].physical = p;
            *(int *)shareable = fd;
            goto out;
        }
    close(fd);
    FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    LEAVE;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out, void *os_handle, int type) {
    ENTER(0);
    struct stat st;
    if (!out || type != 1 || fstat((int)(intptr_t)os_handle, &st) != 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    for (int i = 0; i < MAX_ITEMS; i++)
        if (exports[i].physical && exports[i].inode == st.st_ino && find((void **)physicals, exports[i].physical) >= 0) {
            exports[i].physical->retains++;
            *out = (CUmemGenericAllocationHandle)(uintptr_t)exports[i].physical;
            goto out;
        }
    FAIL(CUDA_ERROR_INVALID_VALUE);
    LEAVE;
}

CUresult cuMemMap(CUdeviceptr address, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    ENTER(1);
    if (capture_forbids_unsafe_calls()) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    struct physical *p = physical_of(handle);
    struct reservation *r = reservation_holding((uintptr_t)address);
    if (!p || !r || flags || size == 0 || !aligned(size) || !aligned(offset) || !aligned(address - r->base))
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (offset + size > p->size || address + size > r->base + r->size || mapped_within(address, size))
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (mapping_count == MAX_ITEMS) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    mappings[mapping_count++] = (struct mapping){address, size, p, next_serial++};
    p->mappings++;
    LEAVE;
}

/* The range must contain whole mappings only, and be fully mapped. */
static int whole_mappings(uintptr_t address, size_t size) {
    size_t covered = 0;
    for (int i = 0; i < mapping_count; i++) {
        struct mapping *m = &mappings[i];
        if (m->address >= address + size || address >= m->address + m->size) continue;
        if (m->address < address || m->address + m->size > address + size) return 0;
        covered += m->size;
    }
    return covered == size;
}

CUresult cuMemSetAccess(CUdeviceptr address, size_t size, const struct access_desc *desc, size_t n) {
    ENTER(1);
    struct reservation *r = reservation_holding((uintptr_t)address);
    if (!desc || n == 0 || !r || !whole_mappings(address, size)) FAIL(CUDA_ERROR_INVALID_VALUE);
    int self = 0;
    for (size_t i = 0; i < n; i++) {
        if (desc[i].location.type != 1 || !device_ok(desc[i].location.id) || desc[i].flags != 3)
            FAIL(CUDA_ERROR_INVALID_VALUE);
        self |= desc[i].location.id == mapping_holding(address)->physical->device;
    }
    if (!self) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (mprotect((void *)(uintptr_t)address, size, PROT_READ | PROT_WRITE) != 0) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    memset(r->accessible + (address - r->base) / granularity(), 1, size / granularity());
    LEAVE;
}

static long long unmaps_until_failure = -1;

CUresult cuMemUnmap(CUdeviceptr address, size_t size) {
    ENTER(1);
    if (capture_forbids_unsafe_calls()) FAIL(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    struct reservation *r = reservation_holding((uintptr_t)address);
    if (!r || size == 0 || !whole_mappings(address, size)) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (unmaps_until_failure < 0) unmaps_until_failure = env_number("FAKE_CUDA_FAIL_UNMAP", 0);
    if (unmaps_until_failure > 0 && --unmaps_until_failure == 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (kernel_pending_on(address, size, next_order, NULL))
        violation("cuMemUnmap of memory a pending kernel uses", address, size);
    for (int i = 0; i < mapping_count;) {
        struct mapping *m = &mappings[i];
        if (m->address >= address && m->address < address + size) {
            struct physical *p = m->physical;
            *m = mappings[--mapping_count];
            p->mappings--;
            maybe_destroy(p);
        } else {
            i++;
        }
    }
    mprotect((void *)(uintptr_t)address, size, PROT_NONE);
    madvise((void *)(uintptr_t)address, size, MADV_DONTNEED);
    memset(r->accessible + (address - r->base) / granularity(), 0, size / granularity());
    LEAVE;
}

/* ---- error text ---- */

CUresult cuGetErrorName(CUresult error, const char **text) {
    static const char unknown[] = "CUDA_ERROR_FAKE";
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    (void)error;
    *text = unknown;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **text) { return cuGetErrorName(error, text); }
