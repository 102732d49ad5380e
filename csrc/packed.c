/* Packed arrays (see packed.h for the layout).
 *
 *   PackedMapping  a read-only MAP_SHARED mapping of a packed segment or file
 *   PackedView     items [start, start + step, ...) of a mapping; the base class of
 *                  fastloader.PackedStringArray / PackedArray (python/fastloader/packed.py)
 *   PackedWriter   streams items into a segment or file through pwrite()
 *   packed_scan()  a sorted directory scan straight into a writer
 *
 * Reading an item touches only the mapping (shared pages) and creates the one
 * object returned, so forked workers dirty no copy-on-write pages.
 *
 * The mapping is shared memory that another process may write while we read it
 * (a loaded file, a named segment). So every offset is read exactly once
 * (load_offset) into a local, checked against the data size, and only the checked
 * local is used; code that needs an item twice keeps what it read the first time.
 * Index arithmetic on views is overflow-checked. A corrupt, hostile or concurrently
 * changing file thus yields an exception or stale bytes, never an access outside
 * the mapping or a buffer; that is what lets load() skip an O(n) check. (A file
 * truncated while mapped is another matter: the kernel raises SIGBUS on the
 * missing pages, hence the documented rule to replace a loaded file by rename.) */
#include "packed_internal.h"

_Static_assert(sizeof(fl_packed_hdr) == FL_PACKED_HDR_SIZE, "packed header is 64 bytes");

/* Files: packed_map.c (PackedMapping), packed_view.c (PackedView),
 * packed_writer.c (PackedWriter), packed_scan.c (packed_scan()), packed_util.c. */
int
fl_packed_init(PyObject *module)
{
    if (fl_packed_mapping_init(module) < 0 || fl_packed_view_init(module) < 0 ||
        fl_packed_writer_init(module) < 0 || fl_packed_scan_init(module) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "PACKED_STR", FL_PACKED_STR) < 0 ||
        PyModule_AddIntConstant(module, "PACKED_PICKLE", FL_PACKED_PICKLE) < 0 ||
        PyModule_AddIntConstant(module, "PACKED_HEADER_SIZE", FL_PACKED_HDR_SIZE) < 0)
        return -1;
    return 0;
}
