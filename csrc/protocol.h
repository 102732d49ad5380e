/* The worker protocol: every numeric code that crosses the main/worker boundary
 * (task kinds in the task ring, result kinds and payload places in the result
 * ring, the result that means "worker died"). One header, included by every C
 * user; the same values are exposed on fastloader._core (see FL_PROTOCOL_CONSTANTS)
 * so python/fastloader/protocol.py can be checked against them by a test.
 * The values are part of the shared-memory format: never renumber them. */
#ifndef FL_PROTOCOL_H
#define FL_PROTOCOL_H

/* task kinds (fl_task_hdr.kind) */
enum {
    FL_TASK_PAD = 0,      /* ring framing: filler up to the end of the byte ring,
                             never seen by Python */
    FL_TASK_INDICES = 1,  /* payload: int64[n] -> list of int */
    FL_TASK_INDEX = 2,    /* payload: int64 -> int */
    FL_TASK_NONES = 3,    /* payload: int64 n -> [None] * n (iterable datasets) */
    FL_TASK_PICKLE = 4,   /* payload: pickle bytes of the index object */
    FL_TASK_RESUME = 5,   /* persistent workers: start a new epoch */
    FL_TASK_SHUTDOWN = 6,
    FL_TASK_CONTROL = 7,  /* payload: pickle of a Python-level control message
                             (its words are Python's: see protocol.py) */
};

/* result kinds (fl_result.kind, and the `kind` recv() returns) */
enum {
    FL_RES_DEAD = 0,      /* never in the ring: recv() reports a worker's death so */
    FL_RES_BATCH = 1,
    FL_RES_ERROR = 2,     /* payload: an ExceptionWrapper (recv(): or the exception
                           * that rebuilding a batch raised in the main process) */
    FL_RES_ITER_END = 3,  /* the worker's IterableDataset replica is exhausted */
    FL_RES_RESUMED = 4,   /* acknowledges FL_TASK_RESUME */
    FL_RES_BATCH_SNAP = 5, /* payload: (batch, worker snapshot) for resuming */
};

/* where a result's payload lies (fl_result.where, and recv()'s `where`) */
enum { FL_WHERE_NONE = 0, FL_WHERE_SLOT = 1, FL_WHERE_OVERFLOW = 2 };

/* sequence number recv() reports with FL_RES_DEAD */
#define FL_SEQ_DEAD (-1LL)

/* The constants fastloader._core exposes, name and value: X(NAME, value).
 * STRATEGY_* come from fl_common.h. */
#define FL_PROTOCOL_CONSTANTS(X)                                                     \
    X("TASK_INDICES", FL_TASK_INDICES) X("TASK_INDEX", FL_TASK_INDEX)                \
    X("TASK_NONES", FL_TASK_NONES) X("TASK_PICKLE", FL_TASK_PICKLE)                  \
    X("TASK_RESUME", FL_TASK_RESUME) X("TASK_SHUTDOWN", FL_TASK_SHUTDOWN)            \
    X("TASK_CONTROL", FL_TASK_CONTROL)                                               \
    X("RES_DEAD", FL_RES_DEAD) X("RES_BATCH", FL_RES_BATCH)                          \
    X("RES_ERROR", FL_RES_ERROR) X("RES_ITER_END", FL_RES_ITER_END)                  \
    X("RES_RESUMED", FL_RES_RESUMED) X("RES_BATCH_SNAP", FL_RES_BATCH_SNAP)          \
    X("WHERE_NONE", FL_WHERE_NONE) X("WHERE_SLOT", FL_WHERE_SLOT)                    \
    X("WHERE_OVERFLOW", FL_WHERE_OVERFLOW)
#endif
