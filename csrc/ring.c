#include "fl_common.h"
#include "protocol.h"
#include "ring.h"
#include <errno.h>
#include <string.h>
#include <unistd.h>

size_t
fl_ctl_layout(uint64_t task_cap, uint32_t res_cap, uint32_t free_cap)
{
    size_t off = FL_ALIGN_UP(sizeof(fl_ctl), FL_CL);
    off += FL_ALIGN_UP((size_t)res_cap * sizeof(fl_result), FL_CL);
    off += FL_ALIGN_UP((size_t)free_cap * sizeof(uint64_t), FL_CL);
    off += task_cap;
    return FL_ALIGN_UP(off, 4096);
}

void
fl_ctl_init(fl_ctl *c, uint32_t worker_id, uint64_t task_cap, uint32_t res_cap,
            uint32_t free_cap)
{
    memset(c, 0, sizeof(*c));
    c->magic = FL_CTL_MAGIC;
    c->version = FL_CTL_VERSION;
    c->worker_id = worker_id;
    c->task_cap = task_cap;
    c->res_cap = res_cap;
    c->free_cap = free_cap;
    c->res_off = FL_ALIGN_UP(sizeof(fl_ctl), FL_CL);
    c->free_off = c->res_off + FL_ALIGN_UP((size_t)res_cap * sizeof(fl_result), FL_CL);
    c->task_off = c->free_off + FL_ALIGN_UP((size_t)free_cap * sizeof(uint64_t), FL_CL);
    c->total = fl_ctl_layout(task_cap, res_cap, free_cap);
}

static int
is_pow2(uint64_t v)
{
    return v && !(v & (v - 1));
}

int
fl_ctl_check(const fl_ctl *c, size_t mapped)
{
    if (c->magic != FL_CTL_MAGIC || c->version != FL_CTL_VERSION)
        return FL_CORRUPT;
    if (!is_pow2(c->task_cap) || !is_pow2(c->res_cap) || !is_pow2(c->free_cap))
        return FL_CORRUPT;
    if (c->total > mapped || c->task_off + c->task_cap > c->total)
        return FL_CORRUPT;
    return FL_OK;
}

#define TASKS(c) ((uint8_t *)(c) + (c)->task_off)
#define RESULTS(c) ((fl_result *)((uint8_t *)(c) + (c)->res_off))
#define FREES(c) ((uint64_t *)((uint8_t *)(c) + (c)->free_off))

/* The producer (main) is the only writer of task_head, so it can keep the
 * reservation in the record itself: reserve writes padding when the record would
 * wrap, and commit publishes head. */
int
fl_task_reserve(fl_ctl *c, uint64_t payload_len, uint8_t **payload_out)
{
    uint64_t need = FL_ALIGN_UP(sizeof(fl_task_hdr) + payload_len, 32);
    uint64_t head = atomic_load_explicit(&c->task_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&c->task_tail, memory_order_acquire);
    uint64_t pos = head & (c->task_cap - 1);
    uint64_t to_end = c->task_cap - pos;
    uint64_t pad = to_end < need ? to_end : 0;
    if (need > c->task_cap / 2 || (head - tail) + pad + need > c->task_cap)
        return FL_FULL;
    if (pad) {
        fl_task_hdr *h = (fl_task_hdr *)(TASKS(c) + pos);
        h->len = (uint32_t)pad;
        h->kind = FL_TASK_PAD;
        h->seq = -1;
        h->payload_len = 0;
        atomic_store_explicit(&c->task_head, head + pad, memory_order_release);
        pos = 0;
    }
    *payload_out = TASKS(c) + pos + sizeof(fl_task_hdr);
    return FL_OK;
}

void
fl_task_commit(fl_ctl *c, uint32_t kind, int64_t seq, uint64_t payload_len)
{
    uint64_t head = atomic_load_explicit(&c->task_head, memory_order_relaxed);
    fl_task_hdr *h = (fl_task_hdr *)(TASKS(c) + (head & (c->task_cap - 1)));
    h->len = (uint32_t)FL_ALIGN_UP(sizeof(fl_task_hdr) + payload_len, 32);
    h->kind = kind;
    h->seq = seq;
    h->payload_len = payload_len;
    atomic_store_explicit(&c->task_head, head + h->len, memory_order_release);
}

int
fl_task_peek(fl_ctl *c, fl_task_hdr *hdr, const uint8_t **payload)
{
    for (;;) {
        uint64_t tail = atomic_load_explicit(&c->task_tail, memory_order_relaxed);
        uint64_t head = atomic_load_explicit(&c->task_head, memory_order_acquire);
        if (head == tail)
            return 0;
        uint64_t pos = tail & (c->task_cap - 1);
        if (c->task_cap - pos < sizeof(fl_task_hdr))
            return FL_CORRUPT;
        memcpy(hdr, TASKS(c) + pos, sizeof(*hdr));
        if (hdr->len < sizeof(fl_task_hdr) || hdr->len > c->task_cap - pos ||
            hdr->len > head - tail || hdr->payload_len > hdr->len - sizeof(fl_task_hdr))
            return FL_CORRUPT;
        if (hdr->kind == FL_TASK_PAD) {
            atomic_store_explicit(&c->task_tail, tail + hdr->len, memory_order_release);
            continue;
        }
        *payload = TASKS(c) + pos + sizeof(fl_task_hdr);
        return 1;
    }
}

void
fl_task_pop(fl_ctl *c, const fl_task_hdr *hdr)
{
    uint64_t tail = atomic_load_explicit(&c->task_tail, memory_order_relaxed);
    atomic_store_explicit(&c->task_tail, tail + hdr->len, memory_order_release);
}

int
fl_res_push(fl_ctl *c, const fl_result *r)
{
    uint64_t head = atomic_load_explicit(&c->res_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&c->res_tail, memory_order_acquire);
    if (head - tail >= c->res_cap)
        return FL_FULL;
    RESULTS(c)[head & (c->res_cap - 1)] = *r;
    atomic_store_explicit(&c->res_head, head + 1, memory_order_release);
    return FL_OK;
}

int
fl_res_pop(fl_ctl *c, fl_result *r)
{
    uint64_t tail = atomic_load_explicit(&c->res_tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&c->res_head, memory_order_acquire);
    if (head == tail)
        return 0;
    if (head - tail > c->res_cap)
        return FL_CORRUPT;
    *r = RESULTS(c)[tail & (c->res_cap - 1)];
    atomic_store_explicit(&c->res_tail, tail + 1, memory_order_release);
    return 1;
}

int
fl_res_empty(fl_ctl *c)
{
    return atomic_load_explicit(&c->res_head, memory_order_acquire) ==
           atomic_load_explicit(&c->res_tail, memory_order_relaxed);
}

int
fl_free_push(fl_ctl *c, uint64_t v)
{
    uint64_t head = atomic_load_explicit(&c->free_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&c->free_tail, memory_order_acquire);
    if (head - tail >= c->free_cap)
        return FL_FULL;
    FREES(c)[head & (c->free_cap - 1)] = v;
    atomic_store_explicit(&c->free_head, head + 1, memory_order_release);
    return FL_OK;
}

int
fl_free_pop(fl_ctl *c, uint64_t *v)
{
    uint64_t tail = atomic_load_explicit(&c->free_tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&c->free_head, memory_order_acquire);
    if (head == tail)
        return 0;
    *v = FREES(c)[tail & (c->free_cap - 1)];
    atomic_store_explicit(&c->free_tail, tail + 1, memory_order_release);
    return 1;
}

void
fl_wake(_Atomic uint32_t *waiting, int efd)
{
    /* Pairs with the sleeper's store of *waiting followed by its re-check of the
     * ring: one of the two sides always sees the other's write. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(waiting, memory_order_relaxed)) {
        uint64_t one = 1;
        ssize_t n;
        do {
            n = write(efd, &one, sizeof(one));
        } while (n < 0 && errno == EINTR);
    }
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
