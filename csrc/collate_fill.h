/* C fill for torch's default collation of numbers and NumPy arrays: the worker's
 * collate asks column_kind() whether a column of samples is one it can prove
 * identical to default_collate's result, and the encoder's fill hook calls
 * fill_column() to write that column straight into the ring slot. */
#ifndef FL_COLLATE_FILL_H
#define FL_COLLATE_FILL_H
#include "state.h"

/* column_kind() results (mirrored by python/fastloader/collate.py) */
enum {
    FL_COL_OTHER = 0,   /* not provable: torch's own path */
    FL_COL_INT64 = 1,   /* exact ints, all within int64 -> torch.int64 */
    FL_COL_FLOAT64 = 2, /* exact floats -> torch.float64 */
    FL_COL_BOOL = 3,    /* exact bools -> torch.bool */
    FL_COL_ARRAY = 4,   /* exact ndarrays, one numeric native dtype, one shape */
    FL_COL_ARRAY_READONLY = 5, /* FL_COL_ARRAY, and some array is not writable */
};

int fl_collate_fill_init(PyObject *module);
#endif
