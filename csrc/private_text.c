#include "private_text.h"
#include <string.h>

/* most strings of a batch or a packed array (labels, file names) fit here */
#define FL_TEXT_STACK 256

PyObject *
fl_utf8_from_shared(const char *p, Py_ssize_t n, const char *errors)
{
    if (n <= 0)
        return PyUnicode_DecodeUTF8(p, 0, errors);   /* reads nothing */
    char small[FL_TEXT_STACK];
    char *copy = small;
    if (n > (Py_ssize_t)sizeof(small)) {
        copy = PyMem_Malloc((size_t)n);
        if (copy == NULL)
            return PyErr_NoMemory();
    }
    memcpy(copy, p, (size_t)n);
    PyObject *s = PyUnicode_DecodeUTF8(copy, n, errors);
    if (copy != small)
        PyMem_Free(copy);
    return s;
}
