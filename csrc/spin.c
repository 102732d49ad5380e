/* Adaptive spinning before a process sleeps: see spin.h. */
#define _GNU_SOURCE
#include "spin.h"
#include "self_pid.h"
#include <sched.h>
#include <time.h>
#include <unistd.h>

uint64_t
fl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Spinning helps only where another CPU can run the process that will hand us
 * work; with one usable CPU it only delays that process. Cached per process: a
 * forked worker asks again (its worker_init_fn may have narrowed its affinity). */
static int
several_cpus(void)
{
    static int cached = -1;
    static pid_t cached_for = 0;
    pid_t me = fl_self_pid();
    if (cached < 0 || cached_for != me) {
        cpu_set_t set;
        cached = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) > 1
                                                              : sysconf(_SC_NPROCESSORS_ONLN) > 1;
        cached_for = me;
    }
    return cached;
}

/* A success adds 2 and a failure takes 1 (a spin that catches one task in three
 * still saves the main process more than the spins cost), up to a cap: after a
 * change of pace, a few failures in a row stop the spinning. */
#define SCORE_START 8
#define SCORE_MAX 8
#define RETRY_EVERY 16

static void
record(fl_spin *s, int spun_ok)
{
    if (spun_ok)
        s->score = s->score + 2 > SCORE_MAX ? SCORE_MAX : s->score + 2;
    else if (s->score > -1)
        s->score--;
}

int
fl_spin_wait(fl_spin *s, uint64_t max_ns, int (*ready)(void *), void *arg)
{
    s->waits++;
    if (s->waits == 1)
        s->score = SCORE_START;
    if ((s->score <= 0 && s->waits % RETRY_EVERY != 0) || !several_cpus())
        return 0;
    uint64_t until = fl_now_ns() + max_ns;
    do {
        for (int i = 0; i < 64; i++)
            cpu_relax();
        if (ready(arg)) {
            record(s, 1);
            return 1;
        }
    } while (fl_now_ns() < until);
    record(s, 0);
    return 0;
}

