/* Adaptive spinning before a process sleeps: a worker for its next task, and
 * (where a CPU is spare, see recv.c) the main process for its next batch.
 *
 * Waking a sleeping worker costs the main process a system call and, when the
 * worker's CPU is idle, an inter-processor interrupt: measured on a 2-vCPU KVM
 * guest, 15-20 us of the main process's CPU per put_index that must wake one,
 * against ~1 us when the worker is awake. When the workers keep up with the
 * consumer, a worker that ran out of tasks gets its next one within tens of
 * microseconds: spinning that long (GIL released) instead of sleeping lets the
 * main process skip the wake-up. When tasks come slowly (a consumer that trains
 * between batches) every spin ends in a sleep anyway and would only burn CPU, so
 * the worker spins only while recent spins often caught their task (re-trying
 * one wait in 16 otherwise), and never on one CPU. */
#ifndef FL_SPIN_H
#define FL_SPIN_H

#include <stdint.h>

/* The longest a worker spins for a task before it sleeps. */
#define FL_SPIN_MAX_NS 50000u

typedef struct {
    int score;          /* > 0: recent spins often ended with a task (see spin.c) */
    uint32_t waits;     /* waits since the start, to re-try now and then */
} fl_spin;

/* Spin for at most max_ns while ready(arg) is 0, if recent spins paid off.
 * Returns 1 if ready() turned true while spinning. Call without the GIL; one
 * thread at a time per fl_spin. */
int fl_spin_wait(fl_spin *s, uint64_t max_ns, int (*ready)(void *), void *arg);

/* CLOCK_MONOTONIC in nanoseconds (the spin's clock, and the worker's busy/idle
 * accounting's). */
uint64_t fl_now_ns(void);

#endif
