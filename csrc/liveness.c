#define _GNU_SOURCE
#include "fl_common.h"
#include "liveness.h"
#include "self_pid.h"
#include "shm_names.h"
#include "shm.h"
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

int
fl_pidfd_open(pid_t pid, int *err)
{
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    return fd;
}

int
fl_proc_dead(pid_t pid, int pidfd)
{
    if (pidfd >= 0) {
        struct pollfd p = {.fd = pidfd, .events = POLLIN};
        int n;
        do {
            n = poll(&p, 1, 0);
        } while (n < 0 && errno == EINTR);
        return n > 0;
    }
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0)
        return si.si_pid != 0;
    return kill(pid, 0) < 0 && errno == ESRCH;
}

/* Worker-process globals: a worker serves exactly one channel. */
static fl_ctl *g_ctl;
static char g_prefix[200];
static int g_main_pidfd = -1;
static pid_t g_main_pid;
/* The process that armed its watch (0: none). A process forked from it (a worker
 * forked by a process that had itself served a channel: a test's loopback, a
 * worker's own loader) inherits these globals but neither the watchdog thread
 * nor the timer, and a parent-death signal set for another parent: it arms its
 * own. */
static pid_t g_armed_pid;
/* Named segments vs. cleanup after the main process died: a worker thread may be
 * between reserving a segment id and creating its name while the watchdog
 * unlinks the pending range. `g_dying` stops new creations; `g_creating` counts
 * those in flight, which the watchdog waits for before it unlinks. */
static _Atomic int g_dying;
static _Atomic int g_creating;

void
fl_worker_disarm(fl_ctl *ctl)
{
    if (g_ctl == ctl)
        g_ctl = NULL;   /* its mapping is going away */
}

int
fl_worker_begin_create(void)
{
    atomic_fetch_add(&g_creating, 1);
    if (atomic_load(&g_dying)) {
        atomic_fetch_sub(&g_creating, 1);
        return -1;
    }
    return 0;
}

void
fl_worker_end_create(void)
{
    atomic_fetch_sub(&g_creating, 1);
}

void
fl_worker_unlink_pending(void)
{
    atomic_store(&g_dying, 1);
    if (g_prefix[0] == '\0')
        return;
    /* let creations in flight finish (bounded: never hang an exiting worker) */
    for (int i = 0; i < 2000 && atomic_load(&g_creating) > 0; i++)
        usleep(100);
    fl_shm_unlink_prefix(g_prefix);
}

static volatile sig_atomic_t g_watchdog_running;

static int
main_is_gone(void)
{
    if (g_main_pidfd >= 0) {
        struct pollfd p = {.fd = g_main_pidfd, .events = POLLIN};
        return poll(&p, 1, 0) > 0;
    }
    return getppid() != g_main_pid && kill(g_main_pid, 0) < 0;
}

/* PR_SET_PDEATHSIG fires when the *thread* that forked us exits (and again for
 * each parent thread we are handed to), which need not mean the main process is
 * gone: only act if it really is. Without a watchdog thread, the watch timer's
 * signal (arm_watch_timer) runs this too. */
static void
on_parent_death(int sig)
{
    (void)sig;
    /* Only mark it: this may run on the very thread that is creating a segment,
     * which the cleanup would then wait for. The watchdog thread (woken by the
     * main process's pidfd) unlinks and exits; without a watchdog, do it here. */
    if (main_is_gone()) {
        atomic_store(&g_dying, 1);
        if (!g_watchdog_running) {
            fl_worker_unlink_pending();
            _exit(1);
        }
    }
}

static void *
watchdog(void *arg)
{
    (void)arg;
    for (;;) {
        if (g_main_pidfd >= 0) {
            struct pollfd p = {.fd = g_main_pidfd, .events = POLLIN};
            int n = poll(&p, 1, -1);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0)
                return NULL;
        }
        else {
            usleep(200 * 1000);
        }
        if (main_is_gone()) {
            fl_worker_unlink_pending();
            _exit(1);
        }
    }
    return NULL;
}

static int
start_watchdog(void)
{
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    /* The watchdog must not take signals meant for the Python main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    g_watchdog_running = 1;
    int rc = pthread_create(&t, &attr, watchdog, NULL);
    if (rc != 0)
        g_watchdog_running = 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return rc;
}

/* No thread to be had for the watchdog: EAGAIN at the user's process limit or a
 * cgroup's pids.max, which count threads (the fork itself got through). Failing
 * the worker would fail the epoch with an exit code and no cause, so it goes on
 * and looks for the main process's death on a timer until a thread can be had
 * (fl_worker_watch_retry): a signal every WATCH_TIMER_S runs on_parent_death,
 * which cleans up and exits once the main process is gone. PR_SET_PDEATHSIG
 * alone would not do: its signal comes from our parent, which is not the main
 * process under forkserver, and it can come before the main process's pidfd reads
 * as exited (then it is not sent again). The timer is a kernel object, not a
 * task; a fork of this worker does not inherit it. Its signal interrupts system
 * calls in the dataset's code once a second (EINTR, which Python retries; tmpfs's
 * fallocate on the 6.18 development kernel did not stop for it: a 2 GiB
 * reservation under a 10 ms timer never returned EINTR). */
#define WATCH_TIMER_S 1

static timer_t g_watch_timer;
static int g_watch_timer_armed;
static struct timespec g_watch_retry_at;

static int
arm_watch_timer(int sig, int *err)
{
    struct sigevent sev;
    memset(&sev, 0, sizeof(sev));
    sev.sigev_notify = SIGEV_SIGNAL;
    sev.sigev_signo = sig;
    if (timer_create(CLOCK_MONOTONIC, &sev, &g_watch_timer) < 0) {
        *err = errno;
        return FL_ERRNO;
    }
    struct itimerspec every = {{WATCH_TIMER_S, 0}, {WATCH_TIMER_S, 0}};
    if (timer_settime(g_watch_timer, 0, &every, NULL) < 0) {
        *err = errno;
        timer_delete(g_watch_timer);
        return FL_ERRNO;
    }
    g_watch_timer_armed = 1;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &g_watch_retry_at);
    g_watch_retry_at.tv_sec += WATCH_TIMER_S;
    return FL_OK;
}

void
fl_worker_watch_retry(void)
{
    if (!g_watch_timer_armed)
        return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
    if (now.tv_sec < g_watch_retry_at.tv_sec ||
        (now.tv_sec == g_watch_retry_at.tv_sec && now.tv_nsec < g_watch_retry_at.tv_nsec))
        return;
    g_watch_retry_at = now;
    g_watch_retry_at.tv_sec += WATCH_TIMER_S;
    if (start_watchdog() != 0)
        return;   /* still none: the timer goes on */
    /* (a signal already queued still arrives: on_parent_death then finds the
     * watchdog running and leaves it the cleanup) */
    timer_delete(g_watch_timer);
    g_watch_timer_armed = 0;
}

int
fl_worker_arm(fl_ctl *ctl, const char *seg_prefix, pid_t main_pid, int *err)
{
    pid_t self = fl_self_pid();
    int armed = g_armed_pid == self;   /* one watchdog per process, whatever the
                                        * channel count */
    if (!armed) {
        /* nothing inherited is ours: not the prefix (whose names the cleanup
         * would unlink: the parent's), nor its threads or timer; g_ctl is set
         * just below. (An inherited
         * pidfd is left open, not closed: its number may have been closed and
         * reused since the fork.) */
        g_prefix[0] = '\0';
        g_watchdog_running = 0;
        g_watch_timer_armed = 0;
        atomic_store(&g_dying, 0);
        atomic_store(&g_creating, 0);
    }
    g_ctl = ctl;
    g_main_pid = main_pid;
    if (seg_prefix != NULL) {
        size_t n = strlen(seg_prefix);
        if (n >= sizeof(g_prefix)) {
            *err = ENAMETOOLONG;
            return FL_ERRNO;
        }
        memcpy(g_prefix, seg_prefix, n + 1);
    }
    if (armed)
        return FL_OK;
    int dummy;
    g_main_pidfd = fl_pidfd_open(main_pid, &dummy);

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_parent_death;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    int sig = SIGRTMIN + 3;
    if (sigaction(sig, &sa, NULL) < 0 || prctl(PR_SET_PDEATHSIG, sig) < 0) {
        *err = errno;
        return FL_ERRNO;
    }
    /* A fork keeps the signal mask of the thread that forked, which the user's
     * process may have blocked this signal in (seen in the test suite's process):
     * the handler would then never run, for the parent-death signal or for the
     * watch timer (arm_watch_timer) alike. */
    sigset_t ours;
    sigemptyset(&ours);
    sigaddset(&ours, sig);
    pthread_sigmask(SIG_UNBLOCK, &ours, NULL);
    /* The main process may have died before the prctl above took effect. */
    if (main_is_gone()) {
        fl_worker_unlink_pending();
        _exit(1);
    }
    int rc = start_watchdog();
    if (rc == EAGAIN)
        rc = arm_watch_timer(sig, err) == FL_OK ? 0 : -1;
    else if (rc != 0) {
        *err = rc;
        rc = -1;
    }
    if (rc != 0)
        return FL_ERRNO;
    g_armed_pid = self;   /* only once armed: a failed arm is tried again */
    return FL_OK;
}
