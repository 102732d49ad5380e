/* The per-worker control block in shared memory and its three lock-free
 * single-producer/single-consumer rings:
 *   tasks   main -> worker   variable-size records in a byte ring
 *   results worker -> main   fixed-size descriptors of published batches
 *   frees   main -> worker   slots the main process no longer uses
 * Wake-ups go through eventfds, written only when the other side said it sleeps,
 * so a busy pipeline makes no system calls. */
#ifndef FL_RING_H
#define FL_RING_H
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include "protocol.h"

#define FL_CTL_MAGIC 0x464c4354u /* "FLCT" */
#define FL_CTL_VERSION 1u

typedef struct {
    int64_t seq;
    uint32_t kind;
    uint32_t where;
    uint32_t gen;      /* arena generation, for FL_WHERE_SLOT */
    uint32_t slot;
    uint64_t seg;      /* overflow id (FL_WHERE_OVERFLOW) or arena size (new gen) */
    uint64_t nbytes;   /* encoded size */
    uint64_t slot_size;
    uint32_t nslots;
    uint32_t pad;
    /* file_system strategy: the segment's name token and the device and inode its
     * creator saw; the main process opens the name only if it finds that file */
    uint64_t token, dev, ino;
} fl_result;

typedef struct {
    uint32_t len;      /* whole record, header included, multiple of 32 so a
                          header always fits before the end of the ring */
    uint32_t kind;
    int64_t seq;
    uint64_t payload_len;
} fl_task_hdr;

/* A worker's ring arena: slots a multiple of the grain, at most FL_MAX_SLOTS of
 * them, at most FL_ARENA_MAX bytes in all (larger batches overflow into segments
 * of their own). The main process refuses an arena outside these bounds. */
#define FL_ARENA_MAX ((size_t)2 << 30)
#define FL_SLOT_GRAIN ((size_t)64 << 10)
#define FL_MAX_SLOTS 64u

#define FL_CL 64
typedef struct {
    uint32_t magic, version;
    uint32_t worker_id, pad0;
    uint64_t task_cap;     /* bytes, power of two */
    uint32_t res_cap;      /* entries, power of two */
    uint32_t free_cap;     /* entries, power of two */
    uint64_t res_off, free_off, task_off, total;
    _Alignas(FL_CL) _Atomic uint64_t task_head;
    _Alignas(FL_CL) _Atomic uint64_t task_tail;
    _Alignas(FL_CL) _Atomic uint64_t res_head;
    _Alignas(FL_CL) _Atomic uint64_t res_tail;
    _Alignas(FL_CL) _Atomic uint64_t free_head;
    _Alignas(FL_CL) _Atomic uint64_t free_tail;
    _Alignas(FL_CL) _Atomic uint32_t main_waiting;
    _Alignas(FL_CL) _Atomic uint32_t worker_waiting;
    /* segment ids, for the fd-passing check and the names (file_system) */
    _Alignas(FL_CL) _Atomic uint64_t next_seg_id;
    /* written by the worker, read by the main process for loader.stats() */
    _Alignas(FL_CL) _Atomic uint64_t busy_ns;     /* from taking a task to asking again */
    _Atomic uint64_t idle_ns;                      /* waiting for a task */
    _Atomic uint64_t published;
    _Atomic uint64_t overflowed;
    _Atomic uint64_t main_wakeups;                 /* results that found the main
                                                      process asleep: a wake-up each */
    /* the worker's current arena: its size, and the bytes of it reserved so far
     * (slots are reserved as batches first need them, see channel_worker.c) */
    _Atomic uint64_t arena_bytes;
    _Atomic uint64_t arena_reserved;
    /* set by the main process when the worker is to stop: the next task the worker
     * would take reads as FL_TASK_SHUTDOWN, so the tasks queued behind it are
     * skipped (as torch's workers skip their queued indices once told to stop) */
    _Alignas(FL_CL) _Atomic uint32_t stop;
    /* set by the main process while a persistent worker's epoch is over (its
     * iterator ended it; cleared before the next epoch's TASK_RESUME): a worker
     * idle long enough then gives its free slots' pages back (channel_worker.c) */
    _Atomic uint32_t between_epochs;
} fl_ctl;

/* The rings' geometry, copied into each side's own memory when it attaches: the
 * control block is writable by the other process, so its layout fields are read
 * once (and checked) and never trusted again; every head/tail read from it is
 * checked against these capacities before it indexes anything. */
typedef struct {
    fl_ctl *ctl;
    uint8_t *tasks;
    fl_result *results;
    uint64_t *frees;
    uint64_t task_cap;     /* bytes, power of two */
    uint32_t res_cap;      /* entries, power of two */
    uint32_t free_cap;     /* entries, power of two */
    /* the producer's (main's) own task_head: it is the only writer of the shared
     * one and never reads it back, so a worker that overwrites it cannot move
     * where the next record is written */
    uint64_t task_head;
    /* the main process's: where its records wrap (a power of two, at most
     * task_cap). Records stay below it, so only the pages below it are ever
     * reserved; it doubles when a record would not fit twice in it (reserve). */
    uint64_t task_window;
    /* the padding the last reserve wrote before its record, for commit to take */
    uint64_t task_pad;
} fl_ring;

size_t fl_ctl_layout(uint64_t task_cap, uint32_t res_cap, uint32_t free_cap);
/* Where the task ring starts in the block: everything before it is the header and
 * the result and free rings. */
size_t fl_ctl_task_off(uint32_t res_cap, uint32_t free_cap);
/* Main process: lay out a fresh control block; `g` gets the geometry it chose. */
void fl_ctl_init(fl_ring *g, fl_ctl *c, uint32_t worker_id, uint64_t task_cap,
                 uint64_t task_window, uint32_t res_cap, uint32_t free_cap);
/* Worker: read the layout once from the `mapped`-byte block, check it, copy it. */
int fl_ring_attach(fl_ring *g, fl_ctl *c, size_t mapped);

/* tasks: reserve room for a payload, fill it, then commit. FL_FULL: no room now
 * (the worker has not read enough yet), or never (see fl_task_max_payload). */
int fl_task_reserve(fl_ring *g, uint64_t payload_len, uint8_t **payload_out);
/* The largest payload fl_task_reserve can ever place. */
uint64_t fl_task_max_payload(const fl_ring *g);
void fl_task_commit(fl_ring *g, uint32_t kind, int64_t seq, uint64_t payload_len);
/* consumer side: returns 1 and points into the ring when a task is present */
int fl_task_peek(const fl_ring *g, fl_task_hdr *hdr, const uint8_t **payload);
void fl_task_pop(const fl_ring *g, const fl_task_hdr *hdr);

int fl_res_push(const fl_ring *g, const fl_result *r);
int fl_res_has_room(const fl_ring *g);
int fl_res_pop(const fl_ring *g, fl_result *r);
int fl_res_empty(const fl_ring *g);

int fl_free_push(const fl_ring *g, uint64_t v);
int fl_free_pop(const fl_ring *g, uint64_t *v);

/* After publishing: wake the other side if it sleeps (it set *waiting first). */
int fl_wake(_Atomic uint32_t *waiting, int efd);   /* 1: it had to wake the sleeper */
void fl_drain_efd(int efd);
#endif
