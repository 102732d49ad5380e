"""Build fastloader's C extension (CPython API + NumPy C API; never libtorch)."""
import glob
import os

import numpy
from setuptools import Extension, setup

# CI and `make` build with warnings as errors; FASTLOADER_SANITIZE=1 builds with
# AddressSanitizer and UBSan for `make test-asan`.
extra = ["-std=gnu11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"]
link = []
if os.environ.get("FASTLOADER_WERROR") == "1":
    extra.append("-Werror")
if os.environ.get("FASTLOADER_SANITIZE") == "1":
    extra += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
              "-fno-sanitize-recover=undefined"]
    link += ["-fsanitize=address,undefined"]

setup(
    ext_modules=[
        Extension(
            "fastloader._core",
            sources=sorted(glob.glob("csrc/*.c")),
            depends=sorted(glob.glob("csrc/*.h")),
            include_dirs=[numpy.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_20_API_VERSION")],
            extra_compile_args=extra,
            extra_link_args=link,
            # timer_create (liveness.c) lives in librt before glibc 2.34; an empty
            # stub after it
            libraries=["rt"],
        )
    ],
)
