/* Packed arrays: strings or pickled records in one byte buffer plus int64
 * offsets, with no per-item Python objects (the copy-on-read fix).
 *
 * Layout of a packed segment or file (little-endian, all sizes in bytes):
 *
 *   [0, 64)                      header (fl_packed_hdr below)
 *   [64, 64 + data_nbytes)       the items' bytes, back to back
 *   [offsets_off, total)         count + 1 int64 offsets into the data, 8-aligned;
 *                                item i is data[offsets[i], offsets[i + 1])
 *
 * The data comes before the offsets so that a stream of unknown length is written
 * in one pass (the offsets, 8 bytes an item, wait in memory until the end). */
#ifndef FL_PACKED_H
#define FL_PACKED_H
#include "fl_common.h"

#define FL_PACKED_MAGIC "\x89" "FLPACK\n"   /* 8 bytes; the \x89 and \n catch text-mode
                                             * and foreign files, as in PNG */
#define FL_PACKED_VERSION 1
#define FL_PACKED_BYTE_ORDER 0x01020304u
#define FL_PACKED_HDR_SIZE 64

enum fl_packed_kind { FL_PACKED_STR = 1, FL_PACKED_PICKLE = 2 };

typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t kind;            /* fl_packed_kind */
    uint64_t count;           /* items */
    uint64_t data_off;        /* FL_PACKED_HDR_SIZE */
    uint64_t data_nbytes;
    uint64_t offsets_off;     /* multiple of 8 */
    uint64_t total;           /* size of the whole segment or file */
    uint32_t byte_order;      /* FL_PACKED_BYTE_ORDER as the writer stored it */
    uint32_t reserved;        /* 0 */
} fl_packed_hdr;

/* Called once from module_exec: adds PackedMapping, PackedView, PackedWriter,
 * packed_scan() and the PACKED_* constants to the module. */
int fl_packed_init(PyObject *module);
#endif
