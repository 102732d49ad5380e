/* The Python types of the C core and the files that implement them:
 *   Segment       this process's mapping of a shm file: a ring arena, an overflow
 *                 segment, or decode()'s private copy (segment.c; words: shm.h)
 *   BatchOwner    keeps a slot busy while any view of its batch lives (segment.c)
 *   MainChannel   main-process end of one worker's control block (channel_main.c;
 *                 waiting on all of them: recv.c)
 *   WorkerChannel worker-process end (channel_worker.c) */
#ifndef FL_OBJECTS_H
#define FL_OBJECTS_H
#include "state.h"
#include "ring.h"
#include "spin.h"
#include <sys/types.h>

#define FL_NAME_MAX 256

typedef struct SegmentObject SegmentObject;
struct SegmentObject {
    PyObject_HEAD
    void *addr;
    size_t size;
    pid_t pid;          /* a forked child must not unmap what it never used */
    /* Batch mappings of the main process (arena: one part per slot; overflow
     * segment: one part): a fork inherits only the parts a live batch points
     * into (see fl_fork_guard_install). live == NULL: not a batch mapping. */
    uint32_t nparts;
    size_t part_size;
    uint32_t *live;
    /* parts a fork inherited while a batch lived in them: a child may still read
     * them, so they are never handed back to the worker for reuse (retired) */
    uint8_t *inherited;
    SegmentObject *prev, *next;   /* every batch mapping of this process */
};

typedef struct MainChannelObject MainChannelObject;

typedef struct {
    PyObject_HEAD
    SegmentObject *seg;
    MainChannelObject *chan;  /* NULL for overflow segments */
    uint32_t gen;
    uint32_t slot;
    pid_t pid;
} OwnerObject;

struct MainChannelObject {
    PyObject_HEAD
    fl_ctl *ctl;
    fl_ring ring;        /* the rings' geometry, private (see ring.h) */
    size_t ctl_size;
    size_t ctl_reserved; /* bytes of the block reserved so far, from its start (see
                            reserve_tasks in channel_main.c) */
    pid_t owner_pid;
    int worker_id;
    int strategy;
    int ctl_fd;          /* handed to the child, closed once it started */
    int efd_main;        /* worker -> main wake-ups */
    int efd_worker;      /* main -> worker wake-ups */
    int sock_main, sock_worker;
    int pidfd;
    pid_t pid;
    int watch;           /* report this worker's exit as a failure */
    int closed;
    char prefix[200];
    char ctl_name[FL_NAME_MAX];
    uint64_t ctl_dev, ctl_ino;   /* file_system: what the worker must find at ctl_name */
    SegmentObject *arena;
    uint32_t arena_gen;
    /* file_descriptor: an arena whose fd was taken but could not be mapped (no fd
       or memory left): its fd is gone, so its batches fail without another recvmsg */
    int arena_lost;
    uint32_t lost_gen;
    uint64_t arena_slot_size;
    uint32_t arena_nslots;
    uint64_t n_batches, n_slot, n_overflow, n_arenas;
    uint64_t held;       /* slots of the current arena the consumer still holds */
    uint64_t n_retired;  /* slots never handed back: a fork inherited their batch */
    uint64_t n_wakeups;  /* tasks that found the worker asleep: a system call each */
    double wait_s;       /* recv() waiting while this worker's result was the one wanted */
    fl_spin spin;        /* recv()'s spin for a result (channels[0]'s is used) */
};

typedef struct {
    PyObject_HEAD
    fl_ctl *ctl;
    fl_ring ring;        /* the rings' geometry, private (see ring.h) */
    size_t ctl_size;
    int worker_id;
    int strategy;
    int efd_main, efd_worker, sock, main_pidfd;
    pid_t main_pid;
    char prefix[200];
    uint8_t *arena;
    size_t arena_size;
    int arena_fd;        /* kept to reserve slots as they are first needed;
                            file_descriptor: sent with the arena's first batch */
    size_t *reserved;    /* per slot: bytes from its start reserved so far */
    size_t typical;      /* a moving average of the batches' sizes (trim_slots) */
    size_t slot_size;
    uint32_t nslots, nslots_target;
    uint32_t gen;
    uint64_t arena_seg;
    uint64_t arena_token, arena_dev, arena_ino;
    int arena_announced;     /* the main process was told of the current arena */
    char arena_name[FL_NAME_MAX];   /* file_system: unlinked if never announced */
    uint8_t *busy;
    uint64_t last_task_ns;   /* when get_task last returned: busy time starts */
    fl_spin spin;            /* whether to spin before sleeping for a task */
} WorkerChannelObject;

/* Component set-up, called once from module_exec: each adds its types. */
int fl_segment_init(PyObject *module, fl_state *st);        /* Segment, BatchOwner */
int fl_main_channel_init(PyObject *module, fl_state *st);   /* MainChannel */
int fl_worker_channel_init(PyObject *module, fl_state *st); /* WorkerChannel */
int fl_recv_init(PyObject *module);                         /* recv() */

SegmentObject *fl_segment_new(fl_state *st, void *addr, size_t size);
/* A batch mapping split into `nparts` parts of `part_size` bytes (page multiples):
 * not inherited by forks, except the parts that hold a live batch at fork time. */
SegmentObject *fl_segment_new_batch(fl_state *st, void *addr, size_t size, uint32_t nparts,
                                    size_t part_size);
/* A batch now points into / stopped pointing into part `part` of `seg`. */
void fl_segment_hold(SegmentObject *seg, uint32_t part);
void fl_segment_release(SegmentObject *seg, uint32_t part);
/* Did a fork inherit this part while a batch lived in it? */
int fl_segment_inherited(const SegmentObject *seg, uint32_t part);
/* Register (once per process) the os.register_at_fork hook that applies the above. */
int fl_fork_guard_install(void);
/* The one BatchOwner constructor: it references `seg` (and `chan`, NULL for
 * an overflow segment or decoded bytes) and holds part `slot` of `seg` (part 0
 * when slot is UINT32_MAX: not a ring slot) until it dies. New reference. */
PyObject *fl_owner_new(fl_state *st, SegmentObject *seg, MainChannelObject *chan, uint32_t gen,
                       uint32_t slot);
/* MainChannel: turn one result descriptor into recv()'s tuple (recv.c). */
PyObject *fl_mainchan_take(fl_state *st, MainChannelObject *c, const fl_result *r);
/* Raise (ValueError) for a channel that cannot be used here: closed, or inherited
 * by a forked child (its worker serves the parent). Returns NULL. */
PyObject *fl_mainchan_unusable(const MainChannelObject *c);
#endif
