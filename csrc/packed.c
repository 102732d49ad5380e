#include "packed.h"

int
fl_packed_init(PyObject *module)
{
    (void)module;
    return 0;
}
