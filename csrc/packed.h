/* Packed arrays: strings or pickled records in one byte buffer plus int64
 * offsets, with no per-item Python objects (the copy-on-read fix). */
#ifndef FL_PACKED_H
#define FL_PACKED_H
#include "fl_common.h"

/* Called once from module_exec: adds the packed-array types/functions. */
int fl_packed_init(PyObject *module);
#endif
