/* Batch codec: a nested batch <-> bytes in a ring slot.
 *
 * Encoding takes two passes so the batch can be written straight into its final
 * place: fl_plan_build walks the batch (with the GIL), builds the node stream and
 * the list of buffers to copy, and knows the exact size; the caller picks a slot or
 * an overflow segment of that size; fl_plan_write fills it. Decoding returns
 * tensors and arrays that are views of the slot, each holding `owner`.
 *
 * Aliasing is kept as torch's pickling transport keeps it: each tensor storage
 * travels once (a storage table precedes the node stream) and every tensor is a
 * view of its storage with its offset, strides and dtype; the same object met
 * twice is decoded as one object (a memo, as pickle's). NumPy arrays travel by
 * value as NumPy pickles them: C order, or F order when only F-contiguous. */
#ifndef FL_CODEC_H
#define FL_CODEC_H
#include "state.h"

#define FL_BATCH_MAGIC 0x464c4254u /* "FLBT" */

typedef struct fl_plan fl_plan;

fl_plan *fl_plan_new(void);
void fl_plan_free(fl_plan *p);
/* 0 on success; -1 with a Python exception naming the offending type and path */
int fl_plan_build(fl_state *st, fl_plan *p, PyObject *batch);
size_t fl_plan_size(const fl_plan *p);
int fl_plan_write(fl_state *st, fl_plan *p, uint8_t *dst, size_t cap);

PyObject *fl_decode(fl_state *st, const uint8_t *base, size_t cap, PyObject *owner);

/* Called once from module_exec: set_hooks(), set_fast_tensor(), encode(), decode(). */
int fl_codec_init(PyObject *module);
#endif
