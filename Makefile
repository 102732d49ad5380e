# Set-up and checks. `make test` and `make bench` work on a fresh machine with
# nothing but Python: they create .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-stamp
CFLAGS_STRICT := FASTLOADER_WERROR=1
# The suites run in TEST_JOBS pytest-xdist processes. Much of a test's time is spent
# waiting on the processes it starts (workers, fresh interpreters, torch imports), so
# two cut `make test`'s wall time by ~40% on a 2-core machine. TEST_JOBS=0 runs a
# suite in one process (test-asan always does).
TEST_JOBS ?= 2
PYTEST_JOBS := -n $(TEST_JOBS)
# pip byte-compiles what it installs one file at a time: 43 of the 67 s that .venv's
# install took here. PIP_INSTALL installs with --no-compile and $(call compile_site,PY)
# then compiles that interpreter's site-packages on every CPU, which leaves the same
# .pyc files in less time (67 -> 46 s for .venv, 54 -> 45 s for
# .venv-compat). Files that do not compile are skipped, as pip skips them: torch ships
# some for newer Pythons only (torch/testing/_internal/py312_intrinsics.py) that are
# never imported here.
PIP_INSTALL := -m pip install -q --disable-pip-version-check --no-compile
compile_site = $(1) -c "import compileall, sysconfig; \
	compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"

.PHONY: all install test test-compat test-oldtorch test-torch bench bench-ffcv test-asan leakcheck clean

all: test

# requirements-clients.txt: the third-party libraries of tests/clients/ (Lightning, HF
# datasets, pandas, ...), resolved on the same pip command line as the torch pin.
$(DEPS): requirements-dev.txt requirements-clients.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) $(PIP_INSTALL) -r requirements-dev.txt -r requirements-clients.txt
	$(call compile_site,$(VPY))
	touch $@

# The extension is always rebuilt with -Wall -Wextra -Werror.
install: $(DEPS)
	$(CFLAGS_STRICT) $(VPY) -m pip install -q --disable-pip-version-check \
		--no-build-isolation --no-deps -e .

test: install
	$(VPY) -m pytest -q $(PYTEST_JOBS) tests

# A second torch: .venv-compat holds torch 2.14.1 + torchvision 0.29.1 (the pair that
# imports together; see requirements-compat.txt) and runs the torchvision client test
# and the whole conformance suite on it. The package is not built a second time: the
# in-place _core .so that `install` built is tied to CPython 3.11's ABI and NumPy 2's C
# API only (it never links libtorch), so a .pth file puts the same python/ directory
# on the compat venv's path; `install` rebuilding it stays the one build. The .so is all
# this target takes from `install`: .ci/run removes .venv first (disk) and runs
# `make -o install test-compat`. requirements-compat.txt goes in with --no-deps, which
# does not notice a missing dependency, so the import is checked before the stamp.
#
# $(call side_venv,VENV,REQUIREMENTS,MODULES): such a venv of another torch, its
# packages pinned in REQUIREMENTS and installed with --no-deps, MODULES (space
# separated) imported to check it, and python/ on its path by a .pth file.
define side_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python $(PIP_INSTALL) --no-deps -r $(2)
	$(call compile_site,$(1)/bin/python)
	$(1)/bin/python -c "import $(subst $(space),$(comma) ,$(strip $(3)))"
	$(1)/bin/python -c "import sysconfig; open(sysconfig.get_paths()['purelib'] \
		+ '/fastloader-source.pth', 'w').write('$(CURDIR)/python\n')"
	touch $(1)/.deps-stamp
endef
comma := ,
space := $(subst ,, )

CVENV := .venv-compat
CVPY  := $(CVENV)/bin/python
CDEPS := $(CVENV)/.deps-stamp
$(CDEPS): requirements-compat.txt
	$(call side_venv,$(CVENV),requirements-compat.txt,torch torchvision)

test-compat: install $(CDEPS)
	$(CVPY) -c "import fastloader._core as c, torch, torchvision; \
		assert c.__file__.startswith('$(CURDIR)/python/'), c.__file__; \
		print('compat venv: torch', torch.__version__, 'torchvision', \
		torchvision.__version__, 'fastloader from', c.__file__)"
	$(CVPY) -m pytest -q $(PYTEST_JOBS) tests/clients/test_torchvision.py tests/conformance/test_conformance.py

# The oldest torch in range (`torch>=2.1`): .venv-oldtorch holds torch 2.1.2 (PyPI's
# CUDA build, run on the CPU; ~4.5 GB) with NumPy 1.26, and the conformance directory
# runs on it against that torch's own DataLoader, with the same in-place build as
# test-compat. tests/support/torch_features.py says what is skipped there (what torch
# 2.1 lacks or gets wrong itself). Not in CI (the download, and ~15 min on 2 cores when
# it ran in one pytest process):
# run it after a change to how fastloader follows torch's code.
OVENV := .venv-oldtorch
OVPY  := $(OVENV)/bin/python
ODEPS := $(OVENV)/.deps-stamp
$(ODEPS): requirements-oldtorch.txt
	$(call side_venv,$(OVENV),requirements-oldtorch.txt,torch numpy)

test-oldtorch: install $(ODEPS)
	$(OVPY) -c "import fastloader._core as c, torch; \
		assert c.__file__.startswith('$(CURDIR)/python/'), c.__file__; \
		print('oldtorch venv: torch', torch.__version__, 'fastloader from', c.__file__)"
	$(OVPY) -m pytest -q $(PYTEST_JOBS) tests/conformance

# Any other release in range, resolved by pip: `make test-torch TORCH=2.9.1` builds
# .venv-torch-2.9.1 (PyPI's CUDA build of that torch, run on the CPU; 5-7 GB) and
# runs the conformance directory on it as test-oldtorch does. Not in CI.
TORCH ?=
TVENV := .venv-torch-$(TORCH)
test-torch: install
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=<version>"; exit 2; }
	test -x $(TVENV)/bin/python || $(PYTHON) -m venv $(TVENV)
	$(TVENV)/bin/python $(PIP_INSTALL) "torch==$(TORCH)" numpy psutil pytest pytest-xdist
	$(call compile_site,$(TVENV)/bin/python)
	$(TVENV)/bin/python -c "import sysconfig; open(sysconfig.get_paths()['purelib'] \
		+ '/fastloader-source.pth', 'w').write('$(CURDIR)/python\n')"
	$(TVENV)/bin/python -c "import fastloader._core as c, torch; \
		assert c.__file__.startswith('$(CURDIR)/python/'), c.__file__; \
		print('torch', torch.__version__, 'fastloader from', c.__file__)"
	$(TVENV)/bin/python -m pytest -q $(PYTEST_JOBS) tests/conformance

BENCH_DEPS := $(VENV)/.bench-deps-stamp
# requirements-dev.txt rides along for its torch==2.13.0 pin: torchdata and SPDL must
# resolve against that torch, not pull another build.
$(BENCH_DEPS): requirements-bench.txt requirements-dev.txt $(DEPS)
	$(VPY) $(PIP_INSTALL) -r requirements-dev.txt -r requirements-bench.txt
	$(call compile_site,$(VPY))
	touch $@

# The headline benchmark: every workload against torch's DataLoader and the peers
# (torchdata, SPDL) in the same run, the budget table, and PNG charts in
# benchmarks/results/. 15-45 min on a 2-core box.
bench: install $(BENCH_DEPS)
	$(VPY) -m benchmarks.run

# FFCV 1.0.2 beside torch and fastloader (benchmarks/ffcv_peer.py), in its own venv:
# FFCV builds from its sdist against OpenCV and libturbojpeg and pulls in numba, none of
# which `make test` or `make bench` may need. The Debian packages are installed when
# pkg-config cannot find them (as root, like .ci/run does for iproute2). fastloader goes
# in editable, without .venv: the in-place _core .so it builds is tied to CPython 3.11
# and NumPy 2's C API only, the same as `install` builds, so either venv loads it.
FVENV := .venv-ffcv
FVPY  := $(FVENV)/bin/python
FDEPS := $(FVENV)/.deps-stamp
FFCV_APT := libopencv-dev libturbojpeg0-dev pkg-config
FFCV_ARGS ?= --json benchmarks/results/ffcv.json
$(FDEPS): requirements-ffcv.txt requirements-dev.txt
	command -v pkg-config >/dev/null 2>&1 && pkg-config --exists opencv4 libturbojpeg \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq $(FFCV_APT) >/dev/null)
	test -x $(FVPY) || $(PYTHON) -m venv $(FVENV)
	$(FVPY) $(PIP_INSTALL) -r requirements-dev.txt -r requirements-ffcv.txt
	$(call compile_site,$(FVPY))
	touch $@

# Like `install`, fastloader is rebuilt (-Werror) on every run; `make bench-ffcv
# FFCV_ARGS=--quick` for a smoke run.
bench-ffcv: $(FDEPS)
	$(CFLAGS_STRICT) $(FVPY) -m pip install -q --disable-pip-version-check \
		--no-build-isolation --no-deps -e .
	$(FVPY) -m benchmarks.ffcv_peer $(FFCV_ARGS)

# AddressSanitizer + UBSan build of the C core, run against the whole test suite.
# It is built into build/asan (a copy of the package that PYTHONPATH puts first,
# workers included), so the regular build in python/ is never replaced. Python
# itself is not instrumented, so the runtimes are preloaded; leak detection is off
# here (CPython's own allocations at exit are not ours): see `make leakcheck`.
# --capture=sys lets a sanitizer's report (written to fd 2) reach the terminal;
# handle_segv/handle_sigbus=0: the fault tests crash workers on purpose and check
# that they die of that signal, not of ASan's abort.
ASAN_LIB = $(shell gcc -print-file-name=libasan.so)
UBSAN_LIB = $(shell gcc -print-file-name=libubsan.so)
ASAN_PKG = build/asan/pkg
test-asan: install
	rm -rf $(ASAN_PKG) && mkdir -p $(ASAN_PKG)
	cp -r python/fastloader $(ASAN_PKG)/ && rm -f $(ASAN_PKG)/fastloader/*.so
	FASTLOADER_SANITIZE=1 $(CFLAGS_STRICT) $(VPY) setup.py -q build_ext \
		--build-lib $(ASAN_PKG) --build-temp build/asan/tmp --force
	PYTHONPATH=$(CURDIR)/$(ASAN_PKG):$(CURDIR) LD_PRELOAD="$(ASAN_LIB) $(UBSAN_LIB)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:handle_segv=0:handle_sigbus=0 \
		UBSAN_OPTIONS=print_stacktrace=1 \
		$(VPY) -c "import fastloader._core as c, sys; assert '$(ASAN_PKG)' in c.__file__, c.__file__"
	PYTHONPATH=$(CURDIR)/$(ASAN_PKG):$(CURDIR) LD_PRELOAD="$(ASAN_LIB) $(UBSAN_LIB)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:handle_segv=0:handle_sigbus=0 \
		UBSAN_OPTIONS=print_stacktrace=1 \
		FASTLOADER_ASAN=1 $(VPY) -m pytest -q -x --capture=sys tests

# Valgrind over every C path (benchmarks/loopback.py); fails on a leak or memory error
# with a frame in fastloader's C core (CPython/NumPy/torch's own reports ignored).
leakcheck: install
	$(VPY) -m tests.support.valgrind_check

clean:
	rm -rf build *.egg-info python/fastloader/*.so
