/* The sample-to-column step of default collation, for the commonest batch: a
 * list of plain tuples (what most map-style datasets return per sample). */
#ifndef FL_COLLATE_TRANSPOSE_H
#define FL_COLLATE_TRANSPOSE_H
#include "state.h"

int fl_collate_transpose_init(PyObject *module);
#endif
