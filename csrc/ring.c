#include "fl_common.h"
#include "protocol.h"
#include "ring.h"
#include <errno.h>
#include <string.h>
#include <unistd.h>

size_t
fl_ctl_task_off(uint32_t res_cap, uint32_t free_cap)
{
    size_t off = FL_ALIGN_UP(sizeof(fl_ctl), FL_CL);
    off += FL_ALIGN_UP((size_t)res_cap * sizeof(fl_result), FL_CL);
    off += FL_ALIGN_UP((size_t)free_cap * sizeof(uint64_t), FL_CL);
    return off;
}

size_t
fl_ctl_layout(uint64_t task_cap, uint32_t res_cap, uint32_t free_cap)
{
    return FL_ALIGN_UP(fl_ctl_task_off(res_cap, free_cap) + task_cap, 4096);
}

static int
is_pow2(uint64_t v)
{
    return v && !(v & (v - 1));
}

static void
ring_set(fl_ring *g, fl_ctl *c, uint64_t task_cap, uint32_t res_cap, uint32_t free_cap,
         uint64_t res_off, uint64_t free_off, uint64_t task_off)
{
    g->ctl = c;
    g->task_cap = task_cap;
    g->res_cap = res_cap;
    g->free_cap = free_cap;
    g->results = (fl_result *)((uint8_t *)c + res_off);
    g->frees = (uint64_t *)((uint8_t *)c + free_off);
    g->tasks = (uint8_t *)c + task_off;
    g->task_head = 0;   /* a fresh block (main); the worker never produces tasks */
    g->task_window = task_cap;
    g->task_pad = 0;
}

void
fl_ctl_init(fl_ring *g, fl_ctl *c, uint32_t worker_id, uint64_t task_cap, uint64_t task_window,
            uint32_t res_cap, uint32_t free_cap)
{
    uint64_t res_off = FL_ALIGN_UP(sizeof(fl_ctl), FL_CL);
    uint64_t free_off = res_off + FL_ALIGN_UP((size_t)res_cap * sizeof(fl_result), FL_CL);
    uint64_t task_off = fl_ctl_task_off(res_cap, free_cap);
    memset(c, 0, sizeof(*c));
    c->magic = FL_CTL_MAGIC;
    c->version = FL_CTL_VERSION;
    c->worker_id = worker_id;
    c->task_cap = task_cap;
    c->res_cap = res_cap;
    c->free_cap = free_cap;
    c->res_off = res_off;
    c->free_off = free_off;
    c->task_off = task_off;
    c->total = fl_ctl_layout(task_cap, res_cap, free_cap);
    ring_set(g, c, task_cap, res_cap, free_cap, res_off, free_off, task_off);
    if (is_pow2(task_window) && task_window < task_cap)
        g->task_window = task_window;
}

int
fl_ring_attach(fl_ring *g, fl_ctl *c, size_t mapped)
{
    /* each field read once, through a volatile access, into private memory */
    const volatile fl_ctl *v = c;
    uint32_t magic = v->magic, version = v->version;
    uint64_t task_cap = v->task_cap;
    uint32_t res_cap = v->res_cap, free_cap = v->free_cap;
    uint64_t res_off = v->res_off, free_off = v->free_off, task_off = v->task_off;
    uint64_t hdr = FL_ALIGN_UP(sizeof(fl_ctl), FL_CL);
    if (magic != FL_CTL_MAGIC || version != FL_CTL_VERSION)
        return FL_CORRUPT;
    if (!is_pow2(task_cap) || !is_pow2(res_cap) || !is_pow2(free_cap) || mapped < hdr)
        return FL_CORRUPT;
    /* every region inside the mapping, after the header, offsets aligned; the
     * capacities are bounded by `mapped` first, so the products cannot overflow */
    uint64_t room = (uint64_t)mapped;
    if (task_cap > room || res_cap > room / sizeof(fl_result) ||
        free_cap > room / sizeof(uint64_t))
        return FL_CORRUPT;
    if (res_off % FL_CL || free_off % FL_CL || task_off % FL_CL)
        return FL_CORRUPT;
    if (res_off < hdr || res_off > room || room - res_off < res_cap * sizeof(fl_result) ||
        free_off < hdr || free_off > room ||
        room - free_off < free_cap * sizeof(uint64_t) || task_off < hdr ||
        task_off > room || room - task_off < task_cap)
        return FL_CORRUPT;
    ring_set(g, c, task_cap, res_cap, free_cap, res_off, free_off, task_off);
    return FL_OK;
}

uint64_t
fl_task_max_payload(const fl_ring *g)
{
    return g->task_cap / 2 - FL_ALIGN_UP(sizeof(fl_task_hdr), 32);
}

/* The producer (main) is the only writer of task_head, so it can keep the
 * reservation in the record itself: reserve writes padding when the record would
 * wrap, and commit publishes head. Its head is its own copy (g->task_head): the
 * shared one is written, never read, so only the records main laid out decide
 * where it writes (channel_main.c reserves the pages as records reach them).
 * Records are multiples of 32 bytes, so a head that is not is corrupt (and would
 * leave no room for a header before the end).
 *
 * Records wrap at the window, not at the ring's end: the padding then runs from
 * where the last record ended to the end of the ring, which it skips without
 * touching its pages. So a loader whose tasks are small uses (and reserves) only
 * the window, and one big task widens it instead of failing. The usual check of
 * the bytes between tail and head, padding included, against the whole ring is
 * what keeps every unread record from being overwritten, wherever the window is. */
int
fl_task_reserve(fl_ring *g, uint64_t payload_len, uint8_t **payload_out)
{
    fl_ctl *c = g->ctl;
    if (payload_len > fl_task_max_payload(g))   /* also keeps the sums below from wrapping */
        return FL_FULL;
    uint64_t need = FL_ALIGN_UP(sizeof(fl_task_hdr) + payload_len, 32);
    while (need > g->task_window / 2 && g->task_window < g->task_cap)
        g->task_window *= 2;
    uint64_t head = g->task_head;
    uint64_t tail = atomic_load_explicit(&c->task_tail, memory_order_acquire);
    if (head % 32 || head - tail > g->task_cap)
        return FL_CORRUPT;
    uint64_t pos = head & (g->task_cap - 1);
    /* pos <= window: records end at or before it, and it only grows */
    uint64_t to_window = g->task_window > pos ? g->task_window - pos : 0;
    uint64_t pad = to_window < need ? g->task_cap - pos : 0;
    g->task_pad = 0;
    if ((head - tail) + pad + need > g->task_cap)
        return FL_FULL;
    if (pad) {
        fl_task_hdr *h = (fl_task_hdr *)(g->tasks + pos);
        h->len = (uint32_t)pad;
        h->kind = FL_TASK_PAD;
        h->seq = -1;
        h->payload_len = 0;
        /* taken (and published) by the commit, with the record after it: a
         * record that is not committed (its pages could not be reserved, an
         * index beyond int64) leaves no padding behind, which the worker would
         * skip only once a record follows it, while the main process counts its
         * room as taken */
        g->task_pad = pad;
        pos = 0;
    }
    *payload_out = g->tasks + pos + sizeof(fl_task_hdr);
    return FL_OK;
}

void
fl_task_commit(fl_ring *g, uint32_t kind, int64_t seq, uint64_t payload_len)
{
    fl_ctl *c = g->ctl;
    uint64_t head = g->task_head + g->task_pad;   /* past the padding reserve wrote */
    uint64_t len = FL_ALIGN_UP(sizeof(fl_task_hdr) + payload_len, 32);
    uint64_t pos = head & (g->task_cap - 1);
    g->task_pad = 0;
    /* not the record reserve placed (a caller's bug): write nothing */
    if (head % 32 || len > g->task_cap - pos)
        return;
    fl_task_hdr *h = (fl_task_hdr *)(g->tasks + pos);
    h->len = (uint32_t)len;
    h->kind = kind;
    h->seq = seq;
    h->payload_len = payload_len;
    g->task_head = head + len;
    atomic_store_explicit(&c->task_head, head + len, memory_order_release);
}

int
fl_task_peek(const fl_ring *g, fl_task_hdr *hdr, const uint8_t **payload)
{
    fl_ctl *c = g->ctl;
    for (;;) {
        uint64_t tail = atomic_load_explicit(&c->task_tail, memory_order_relaxed);
        uint64_t head = atomic_load_explicit(&c->task_head, memory_order_acquire);
        if (head == tail)
            return 0;
        if (head - tail > g->task_cap)
            return FL_CORRUPT;
        uint64_t pos = tail & (g->task_cap - 1);
        if (g->task_cap - pos < sizeof(fl_task_hdr))
            return FL_CORRUPT;
        memcpy(hdr, g->tasks + pos, sizeof(*hdr));
        if (hdr->len < sizeof(fl_task_hdr) || hdr->len > g->task_cap - pos ||
            hdr->len > head - tail || hdr->payload_len > hdr->len - sizeof(fl_task_hdr))
            return FL_CORRUPT;
        if (hdr->kind == FL_TASK_PAD) {
            atomic_store_explicit(&c->task_tail, tail + hdr->len, memory_order_release);
            continue;
        }
        *payload = g->tasks + pos + sizeof(fl_task_hdr);
        return 1;
    }
}

void
fl_task_pop(const fl_ring *g, const fl_task_hdr *hdr)
{
    fl_ctl *c = g->ctl;
    uint64_t tail = atomic_load_explicit(&c->task_tail, memory_order_relaxed);
    atomic_store_explicit(&c->task_tail, tail + hdr->len, memory_order_release);
}

int
fl_res_has_room(const fl_ring *g)
{
    fl_ctl *c = g->ctl;
    uint64_t head = atomic_load_explicit(&c->res_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&c->res_tail, memory_order_acquire);
    return head - tail < g->res_cap;
}

int
fl_res_push(const fl_ring *g, const fl_result *r)
{
    fl_ctl *c = g->ctl;
    uint64_t head = atomic_load_explicit(&c->res_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&c->res_tail, memory_order_acquire);
    if (head - tail >= g->res_cap)
        return FL_FULL;
    g->results[head & (g->res_cap - 1)] = *r;
    atomic_store_explicit(&c->res_head, head + 1, memory_order_release);
    return FL_OK;
}

int
fl_res_pop(const fl_ring *g, fl_result *r)
{
    fl_ctl *c = g->ctl;
    uint64_t tail = atomic_load_explicit(&c->res_tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&c->res_head, memory_order_acquire);
    if (head == tail)
        return 0;
    if (head - tail > g->res_cap)
        return FL_CORRUPT;
    *r = g->results[tail & (g->res_cap - 1)];
    atomic_store_explicit(&c->res_tail, tail + 1, memory_order_release);
    return 1;
}

int
fl_res_empty(const fl_ring *g)
{
    return atomic_load_explicit(&g->ctl->res_head, memory_order_acquire) ==
           atomic_load_explicit(&g->ctl->res_tail, memory_order_relaxed);
}

int
fl_free_push(const fl_ring *g, uint64_t v)
{
    fl_ctl *c = g->ctl;
    uint64_t head = atomic_load_explicit(&c->free_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&c->free_tail, memory_order_acquire);
    if (head - tail >= g->free_cap)
        return FL_FULL;
    g->frees[head & (g->free_cap - 1)] = v;
    atomic_store_explicit(&c->free_head, head + 1, memory_order_release);
    return FL_OK;
}

int
fl_free_pop(const fl_ring *g, uint64_t *v)
{
    fl_ctl *c = g->ctl;
    uint64_t tail = atomic_load_explicit(&c->free_tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&c->free_head, memory_order_acquire);
    if (head == tail)
        return 0;
    if (head - tail > g->free_cap)
        return FL_CORRUPT;
    *v = g->frees[tail & (g->free_cap - 1)];
    atomic_store_explicit(&c->free_tail, tail + 1, memory_order_release);
    return 1;
}

int
fl_wake(_Atomic uint32_t *waiting, int efd)
{
    /* Pairs with the sleeper's store of *waiting followed by its re-check of the
     * ring: one of the two sides always sees the other's write. */
    atomic_thread_fence(memory_order_seq_cst);
    if (!atomic_load_explicit(waiting, memory_order_relaxed))
        return 0;
    uint64_t one = 1;
    ssize_t n;
    do {
        n = write(efd, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
    return 1;
}

void
fl_drain_efd(int efd)
{
    uint64_t v;
    ssize_t n;
    do {
        n = read(efd, &v, sizeof(v));
    } while (n < 0 && errno == EINTR);
}
