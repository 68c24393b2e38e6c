/* A stand-in for NVIDIA's libnvidia-ml.so.1, for tests/integration/test_nvml_probe.py: it answers the
 * few NVML calls fleet's NvmlProbe makes through pynvml, with the C signatures and return codes of
 * nvml.h. What it answers is read from the file named by FAKE_NVML_FILE on every call, so a test can
 * change it while a process holds the library:
 *   init RC                                  what nvmlInit (nvmlInitWithFlags/nvmlInit_v2) returns
 *   count RC                                 what nvmlDeviceGetCount_v2 returns (0: NVML_SUCCESS)
 *   gpu|NAME|UUID|TOTAL|FREE|RC              one GPU, in index order; RC != 0: every call on it fails
 *   epoch N                                  the driver's load: a process initialised under another
 *                                            epoch (the driver reloaded since) gets Uninitialized
 *                                            from every call until it shuts down and initialises again
 * and each nvmlInit appends a line to the file named by FAKE_NVML_INITS, where that is set.
 * (RC 15 is NVML_ERROR_GPU_IS_LOST, 9 NVML_ERROR_DRIVER_NOT_LOADED). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct fake_device *nvmlDevice_t;

#define MAX_GPUS 64
struct gpu { char name[96]; char uuid[96]; unsigned long long total, free; int rc; };
struct answers { int init_rc, count_rc, epoch, n; struct gpu gpus[MAX_GPUS]; };

static int initialised, init_epoch;

static int stale(const struct answers *a) { return initialised && a->epoch != init_epoch; }

static void load(struct answers *a) {
    memset(a, 0, sizeof *a);
    const char *path = getenv("FAKE_NVML_FILE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) { a->init_rc = 9; return; }
    char line[512];
    while (fgets(line, sizeof line, f)) {
        struct gpu g = {0};
        if (sscanf(line, "init %d", &a->init_rc) == 1 || sscanf(line, "count %d", &a->count_rc) == 1
            || sscanf(line, "epoch %d", &a->epoch) == 1) continue;
        if (a->n < MAX_GPUS && sscanf(line, "gpu|%95[^|]|%95[^|]|%llu|%llu|%d", g.name, g.uuid, &g.total, &g.free, &g.rc) == 5)
            a->gpus[a->n++] = g;
    }
    fclose(f);
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    struct answers a; load(&a);
    const char *inits = getenv("FAKE_NVML_INITS");
    FILE *log = inits ? fopen(inits, "a") : NULL;
    if (log) { fputs("init\n", log); fclose(log); }
    if (a.init_rc == 0) { initialised = 1; init_epoch = a.epoch; }
    return a.init_rc;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { if (!initialised) return 1; initialised = 0; return 0; }

const char *nvmlErrorString(int rc) {
    switch (rc) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
    }
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return 1;
    if (!count) return 2;
    struct answers a; load(&a);
    if (stale(&a)) return 1;
    if (a.count_rc) return a.count_rc;
    *count = (unsigned int)a.n;
    return 0;
}

/* A handle is the index plus one, so that no handle is NULL. */
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised) return 1;
    if (!device) return 2;
    struct answers a; load(&a);
    if (stale(&a)) return 1;
    if (index >= (unsigned int)a.n) return 2;
    if (a.gpus[index].rc) return a.gpus[index].rc;
    *device = (nvmlDevice_t)(size_t)(index + 1);
    return 0;
}

static int lookup(nvmlDevice_t device, struct answers *a, struct gpu **g) {
    if (!initialised) return 1;
    size_t i = (size_t)device;
    load(a);
    if (stale(a)) return 1;
    if (i == 0 || i > (size_t)a->n) return 2;
    *g = &a->gpus[i - 1];
    return (*g)->rc;
}

int nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct answers a; struct gpu *g; int rc = lookup(device, &a, &g);
    if (rc) return rc;
    if (!memory) return 2;
    memory->total = g->total;
    memory->free = g->free;
    memory->used = g->total - g->free;
    return 0;
}

static int copy_out(const char *value, char *out, unsigned int length) {
    if (!out) return 2;
    if (strlen(value) + 1 > length) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    strcpy(out, value);
    return 0;
}

int nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    struct answers a; struct gpu *g; int rc = lookup(device, &a, &g);
    return rc ? rc : copy_out(g->name, name, length);
}

int nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    struct answers a; struct gpu *g; int rc = lookup(device, &a, &g);
    return rc ? rc : copy_out(g->uuid, uuid, length);
}
