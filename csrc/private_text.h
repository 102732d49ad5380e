/* Text decoded from memory that another process can write. */
#ifndef FL_PRIVATE_TEXT_H
#define FL_PRIVATE_TEXT_H

#include "fl_common.h"

/* str from the UTF-8 bytes p[0:n], decoded from a private copy of them: CPython's
 * decoder reads its input more than once (an ASCII check, then a copy), and bytes
 * that change in between would give a str marked ASCII that holds bytes >= 0x80,
 * which indexes past CPython's tables when the str is used. */
PyObject *fl_utf8_from_shared(const char *p, Py_ssize_t n, const char *errors);

#endif
