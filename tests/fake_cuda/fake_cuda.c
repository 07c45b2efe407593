/* A fake CUDA driver (libcuda) over host memory, for testing gpupool's cuda backend without a GPU.
 *
 * It implements the driver calls gpupool makes, with the checks a real driver makes where gpupool
 * could get them wrong: a current context on the calling thread, live handles, copies inside live
 * memory, page-aligned virtual memory calls. Nothing here is a measurement of a GPU.
 *
 * Built by the test suite (tests/cuda_fake.py) as libcuda.so / libcuda.so.1 and found by cudarc's
 * ordinary dynamic loading. Switches, read from the environment at each call:
 *   FAKE_CUDA_DRIVER_VERSION   what cuDriverGetVersion reports (default 13000, CUDA 13.0)
 *   FAKE_CUDA_DEVICE_COUNT     devices (default 1)
 *   FAKE_CUDA_MEMORY           bytes per device (default 1 GiB); beyond it allocations fail
 *                              with CUDA_ERROR_OUT_OF_MEMORY
 *   FAKE_CUDA_INIT_ERROR       a status cuInit returns instead of success (e.g. 100, no device)
 *   FAKE_CUDA_PENDING_QUERIES  how many queries an event stays not ready after it is recorded
 *                              (default 0); synchronizing completes it at once
 * A missing symbol is made at build time, by hiding it with a linker version script.
 * `fake_cuda_calls(name)` counts the calls made to one driver function, for tests to inspect. */

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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
};

#define GRANULARITY ((size_t)2 << 20)
#define MAX_DEVICES 8
#define MAX_ITEMS 65536

/* The driver's objects. Handles given out are pointers to these; every handle passed in is
 * looked up in a registry before use, so a stale or made-up handle is an error, not a crash. */
struct context { int device; int retains; };
struct stream { int live; };
struct event { int live; struct stream *stream; int pending; };
struct allocation { uintptr_t address; size_t size; int device; };
struct physical { size_t size; int device; uintptr_t mapped_at; int released; };
struct reservation { uintptr_t base; size_t size; unsigned char *mapped; unsigned char *accessible; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static struct context contexts[MAX_DEVICES];
static size_t used[MAX_DEVICES];
static __thread struct context *current;

static struct allocation allocations[MAX_ITEMS];
static int allocation_count;
static struct stream *streams[MAX_ITEMS];
static struct event *events[MAX_ITEMS];
static struct physical *physicals[MAX_ITEMS];
static struct reservation reservations[256];
static int reservation_count;

/* ---- switches and call counters ---- */

static long long env_number(const char *name, long long fallback) {
    const char *text = getenv(name);
    return text && *text ? strtoll(text, NULL, 0) : fallback;
}

static int device_count(void) { return (int)env_number("FAKE_CUDA_DEVICE_COUNT", 1); }
static size_t device_memory(void) { return (size_t)env_number("FAKE_CUDA_MEMORY", 1LL << 30); }

struct counter { const char *name; unsigned long long calls; };
static struct counter counters[64];

static void count(const char *name) {
    for (int i = 0; i < 64; i++) {
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
    for (int i = 0; i < 64 && counters[i].name; i++)
        if (strcmp(counters[i].name, name) == 0) calls = counters[i].calls;
    pthread_mutex_unlock(&lock);
    return calls;
}

/* Every driver entry point: count it, take the lock, require cuInit (and a context) first. */
#define ENTER(need_context)                                                    \
    pthread_mutex_lock(&lock);                                                 \
    count(__func__);                                                           \
    CUresult status = CUDA_SUCCESS;                                            \
    if (!initialized) { status = CUDA_ERROR_NOT_INITIALIZED; goto out; }       \
    if ((need_context) && !current) { status = CUDA_ERROR_INVALID_CONTEXT; goto out; }
#define FAIL(code) do { status = (code); goto out; } while (0)
#define LEAVE out: pthread_mutex_unlock(&lock); return status

/* ---- registries ---- */

static int add(void **table, void *item) {
    for (int i = 0; i < MAX_ITEMS; i++)
        if (!table[i]) { table[i] = item; return 1; }
    return 0;
}

static int find(void **table, const void *item) {
    if (!item) return -1;
    for (int i = 0; i < MAX_ITEMS; i++)
        if (table[i] == item) return i;
    return -1;
}

/* The legacy (0x0, 0x1) and per-thread (0x2) default streams always exist. */
static int stream_ok(struct stream *s) {
    return (uintptr_t)s <= 2 || find((void **)streams, s) >= 0;
}

static struct allocation *allocation_at(uintptr_t address) {
    for (int i = 0; i < allocation_count; i++)
        if (allocations[i].address == address) return &allocations[i];
    return NULL;
}

static struct reservation *reservation_holding(uintptr_t address) {
    for (int i = 0; i < reservation_count; i++) {
        struct reservation *r = &reservations[i];
        if (r->base <= address && address < r->base + r->size) return r;
    }
    return NULL;
}

/* Whether [address, address + size) is device memory that may be copied to or from. */
static int range_ok(uintptr_t address, size_t size) {
    for (int i = 0; i < allocation_count; i++) {
        struct allocation *a = &allocations[i];
        if (a->address <= address && address + size <= a->address + a->size) return 1;
    }
    struct reservation *r = reservation_holding(address);
    if (!r || address + size > r->base + r->size) return 0;
    for (uintptr_t page = (address - r->base) / GRANULARITY; page * GRANULARITY < address + size - r->base; page++)
        if (!r->accessible[page]) return 0;
    return 1;
}

static CUresult reserve_memory(int device, size_t size) {
    if (used[device] + size > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
    used[device] += size;
    return CUDA_SUCCESS;
}

/* ---- initialization, devices, contexts ---- */

CUresult cuDriverGetVersion(int *version) {
    pthread_mutex_lock(&lock);
    count(__func__);
    pthread_mutex_unlock(&lock);
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = (int)env_number("FAKE_CUDA_DRIVER_VERSION", 13000);
    return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags) {
    pthread_mutex_lock(&lock);
    count(__func__);
    CUresult status = (CUresult)env_number("FAKE_CUDA_INIT_ERROR", 0);
    if (flags != 0) status = CUDA_ERROR_INVALID_VALUE;
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

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER(0);
    if (!device) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0 || ordinal >= device_count() || ordinal >= MAX_DEVICES) FAIL(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    LEAVE;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice device) {
    ENTER(0);
    if (!ctx) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (device < 0 || device >= device_count() || device >= MAX_DEVICES) FAIL(CUDA_ERROR_INVALID_DEVICE);
    contexts[device].device = device;
    contexts[device].retains++;
    *ctx = &contexts[device];
    LEAVE;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    ENTER(0);
    if (device < 0 || device >= MAX_DEVICES || contexts[device].retains == 0) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    contexts[device].retains--;
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
    if (c && (c < contexts || c >= contexts + MAX_DEVICES || c->retains == 0)) FAIL(CUDA_ERROR_INVALID_CONTEXT);
    current = c;
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
    allocations[allocation_count++] = (struct allocation){(uintptr_t)memory, size, current->device};
    *out = (CUdeviceptr)(uintptr_t)memory;
    return CUDA_SUCCESS;
}

static CUresult release(CUdeviceptr address) {
    struct allocation *a = allocation_at((uintptr_t)address);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    used[a->device] -= a->size;
    free((void *)a->address);
    *a = allocations[--allocation_count];
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size) {
    ENTER(1);
    status = allocate(out, size);
    LEAVE;
}

CUresult cuMemFree_v2(CUdeviceptr address) {
    ENTER(1);
    status = release(address);
    LEAVE;
}

CUresult cuMemAllocAsync(CUdeviceptr *out, size_t size, struct stream *stream) {
    ENTER(1);
    if (!stream_ok(stream)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    status = allocate(out, size);
    LEAVE;
}

CUresult cuMemFreeAsync(CUdeviceptr address, struct stream *stream) {
    ENTER(1);
    if (!stream_ok(stream)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    status = release(address);
    LEAVE;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ENTER(1);
    if (!free_bytes || !total) FAIL(CUDA_ERROR_INVALID_VALUE);
    *total = device_memory();
    *free_bytes = *total - used[current->device];
    LEAVE;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t size) {
    ENTER(1);
    if (!src || !range_ok((uintptr_t)dst, size)) FAIL(CUDA_ERROR_INVALID_VALUE);
    memcpy((void *)(uintptr_t)dst, src, size);
    LEAVE;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size) {
    ENTER(1);
    if (!dst || !range_ok((uintptr_t)src, size)) FAIL(CUDA_ERROR_INVALID_VALUE);
    memcpy(dst, (const void *)(uintptr_t)src, size);
    LEAVE;
}

/* ---- streams and events ---- */

CUresult cuStreamCreate(struct stream **out, unsigned int flags) {
    ENTER(1);
    if (!out || flags > 1) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct stream *s = calloc(1, sizeof *s);
    if (!s || !add((void **)streams, s)) { free(s); FAIL(CUDA_ERROR_OUT_OF_MEMORY); }
    s->live = 1;
    *out = s;
    LEAVE;
}

CUresult cuStreamDestroy_v2(struct stream *s) {
    ENTER(1);
    int i = find((void **)streams, s);
    if (i < 0) FAIL(CUDA_ERROR_INVALID_HANDLE);
    streams[i] = NULL;
    for (int e = 0; e < MAX_ITEMS; e++)
        if (events[e] && events[e]->stream == s) events[e]->stream = NULL;
    free(s);
    LEAVE;
}

/* A stream is busy while an event recorded on it is pending. */
static int stream_busy(struct stream *s) {
    for (int e = 0; e < MAX_ITEMS; e++)
        if (events[e] && events[e]->stream == s && events[e]->pending > 0) return 1;
    return 0;
}

CUresult cuStreamQuery(struct stream *s) {
    ENTER(1);
    if (!stream_ok(s)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (stream_busy(s)) {
        for (int e = 0; e < MAX_ITEMS; e++)
            if (events[e] && events[e]->stream == s && events[e]->pending > 0) events[e]->pending--;
        FAIL(CUDA_ERROR_NOT_READY);
    }
    LEAVE;
}

CUresult cuStreamSynchronize(struct stream *s) {
    ENTER(1);
    if (!stream_ok(s)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    for (int e = 0; e < MAX_ITEMS; e++)
        if (events[e] && events[e]->stream == s) events[e]->pending = 0;
    LEAVE;
}

CUresult cuCtxSynchronize(void) {
    ENTER(1);
    for (int e = 0; e < MAX_ITEMS; e++)
        if (events[e]) events[e]->pending = 0;
    LEAVE;
}

CUresult cuStreamWaitEvent(struct stream *s, struct event *e, unsigned int flags) {
    ENTER(1);
    if (!stream_ok(s) || find((void **)events, e) < 0) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (flags != 0) FAIL(CUDA_ERROR_INVALID_VALUE);
    LEAVE;
}

CUresult cuEventCreate(struct event **out, unsigned int flags) {
    ENTER(1);
    if (!out || flags > 15) FAIL(CUDA_ERROR_INVALID_VALUE);
    struct event *e = calloc(1, sizeof *e);
    if (!e || !add((void **)events, e)) { free(e); FAIL(CUDA_ERROR_OUT_OF_MEMORY); }
    e->live = 1;
    *out = e;
    LEAVE;
}

CUresult cuEventRecord(struct event *e, struct stream *s) {
    ENTER(1);
    if (find((void **)events, e) < 0 || !stream_ok(s)) FAIL(CUDA_ERROR_INVALID_HANDLE);
    e->stream = s;
    e->pending = (int)env_number("FAKE_CUDA_PENDING_QUERIES", 0);
    LEAVE;
}

CUresult cuEventQuery(struct event *e) {
    ENTER(1);
    if (find((void **)events, e) < 0) FAIL(CUDA_ERROR_INVALID_HANDLE);
    if (e->pending > 0) {
        e->pending--;
        FAIL(CUDA_ERROR_NOT_READY);
    }
    LEAVE;
}

CUresult cuEventSynchronize(struct event *e) {
    ENTER(1);
    if (find((void **)events, e) < 0) FAIL(CUDA_ERROR_INVALID_HANDLE);
    e->pending = 0;
    LEAVE;
}

CUresult cuEventDestroy_v2(struct event *e) {
    ENTER(1);
    int i = find((void **)events, e);
    if (i < 0) FAIL(CUDA_ERROR_INVALID_HANDLE);
    events[i] = NULL;
    free(e);
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
           prop->location.id >= 0 && prop->location.id < device_count();
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const struct allocation_prop *prop, int option) {
    ENTER(0);
    if (!granularity || !prop_ok(prop) || option < 0 || option > 1) FAIL(CUDA_ERROR_INVALID_VALUE);
    *granularity = GRANULARITY;
    LEAVE;
}

CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t alignment, CUdeviceptr hint,
                             unsigned long long flags) {
    ENTER(1);
    (void)hint;
    if (!out || size == 0 || size % GRANULARITY || alignment % GRANULARITY || flags) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (reservation_count == 256) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    /* Over-reserve by one page so the base can be page-aligned, as the driver's are. */
    unsigned char *raw = mmap(NULL, size + GRANULARITY, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t base = ((uintptr_t)raw + GRANULARITY - 1) & ~(GRANULARITY - 1);
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    munmap((void *)(base + size), (uintptr_t)raw + GRANULARITY - base);
    size_t pages = size / GRANULARITY;
    reservations[reservation_count++] = (struct reservation){base, size, calloc(pages, 1), calloc(pages, 1)};
    *out = base;
    LEAVE;
}

CUresult cuMemAddressFree(CUdeviceptr base, size_t size) {
    ENTER(1);
    struct reservation *r = reservation_holding((uintptr_t)base);
    if (!r || r->base != base || r->size != size) FAIL(CUDA_ERROR_INVALID_VALUE);
    for (size_t page = 0; page < size / GRANULARITY; page++)
        if (r->mapped[page]) FAIL(CUDA_ERROR_INVALID_VALUE);
    munmap((void *)r->base, r->size);
    free(r->mapped);
    free(r->accessible);
    *r = reservations[--reservation_count];
    LEAVE;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const struct allocation_prop *prop,
                     unsigned long long flags) {
    ENTER(1);
    if (!out || size == 0 || size % GRANULARITY || !prop_ok(prop) || flags) FAIL(CUDA_ERROR_INVALID_VALUE);
    status = reserve_memory(prop->location.id, size);
    if (status != CUDA_SUCCESS) goto out;
    struct physical *p = calloc(1, sizeof *p);
    if (!p || !add((void **)physicals, p)) { free(p); used[prop->location.id] -= size; FAIL(CUDA_ERROR_OUT_OF_MEMORY); }
    *p = (struct physical){size, prop->location.id, 0, 0};
    *out = (CUmemGenericAllocationHandle)(uintptr_t)p;
    LEAVE;
}

static void destroy_physical(struct physical *p) {
    used[p->device] -= p->size;
    physicals[find((void **)physicals, p)] = NULL;
    free(p);
}

/* As with the driver, memory released while mapped is freed once it is unmapped. */
CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER(0);
    struct physical *p = (struct physical *)(uintptr_t)handle;
    if (find((void **)physicals, p) < 0 || p->released) FAIL(CUDA_ERROR_INVALID_VALUE);
    p->released = 1;
    if (!p->mapped_at) destroy_physical(p);
    LEAVE;
}

CUresult cuMemMap(CUdeviceptr address, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    ENTER(1);
    struct physical *p = (struct physical *)(uintptr_t)handle;
    struct reservation *r = reservation_holding((uintptr_t)address);
    if (find((void **)physicals, p) < 0 || p->released || p->mapped_at) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!r || offset || flags || size != p->size || (address - r->base) % GRANULARITY ||
        address + size > r->base + r->size)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    size_t first = (address - r->base) / GRANULARITY;
    for (size_t page = first; page < first + size / GRANULARITY; page++)
        if (r->mapped[page]) FAIL(CUDA_ERROR_INVALID_VALUE);
    for (size_t page = first; page < first + size / GRANULARITY; page++) r->mapped[page] = 1;
    p->mapped_at = (uintptr_t)address;
    LEAVE;
}

CUresult cuMemSetAccess(CUdeviceptr address, size_t size, const struct access_desc *desc, size_t n) {
    ENTER(1);
    struct reservation *r = reservation_holding((uintptr_t)address);
    if (!desc || n != 1 || desc->location.type != 1 || desc->flags != 3) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!r || size == 0 || size % GRANULARITY || (address - r->base) % GRANULARITY ||
        address + size > r->base + r->size)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    size_t first = (address - r->base) / GRANULARITY;
    for (size_t page = first; page < first + size / GRANULARITY; page++)
        if (!r->mapped[page]) FAIL(CUDA_ERROR_INVALID_VALUE);
    if (mprotect((void *)(uintptr_t)address, size, PROT_READ | PROT_WRITE) != 0) FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    for (size_t page = first; page < first + size / GRANULARITY; page++) r->accessible[page] = 1;
    LEAVE;
}

CUresult cuMemUnmap(CUdeviceptr address, size_t size) {
    ENTER(1);
    struct reservation *r = reservation_holding((uintptr_t)address);
    if (!r || size == 0 || size % GRANULARITY || (address - r->base) % GRANULARITY ||
        address + size > r->base + r->size)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    size_t first = (address - r->base) / GRANULARITY;
    for (size_t page = first; page < first + size / GRANULARITY; page++)
        if (!r->mapped[page]) FAIL(CUDA_ERROR_INVALID_VALUE);
    /* Every physical allocation mapped in the range must lie wholly inside it. */
    for (int i = 0; i < MAX_ITEMS; i++) {
        struct physical *p = physicals[i];
        if (p && p->mapped_at && p->mapped_at < address + size && address < p->mapped_at + p->size &&
            (p->mapped_at < address || p->mapped_at + p->size > address + size))
            FAIL(CUDA_ERROR_INVALID_VALUE);
    }
    for (int i = 0; i < MAX_ITEMS; i++) {
        struct physical *p = physicals[i];
        if (p && p->mapped_at >= address && p->mapped_at < address + size) {
            p->mapped_at = 0;
            if (p->released) destroy_physical(p);
        }
    }
    mprotect((void *)(uintptr_t)address, size, PROT_NONE);
    madvise((void *)(uintptr_t)address, size, MADV_DONTNEED);
    for (size_t page = first; page < first + size / GRANULARITY; page++) r->mapped[page] = r->accessible[page] = 0;
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
