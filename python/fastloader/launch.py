"""Run a training script with fastloader.install() in effect, without editing it:

    python -m fastloader.launch train.py --lr 0.1
    python -m fastloader.launch -m my_package.train --lr 0.1
    torchrun --nproc-per-node 2 -m fastloader.launch train.py --lr 0.1
    accelerate launch -m fastloader.launch train.py --lr 0.1

Every process that runs it calls ``fastloader.install()`` (see install.py), then runs
the script as ``__main__`` with the remaining arguments, as ``python train.py`` would.
``FASTLOADER_INSTALL=file_system`` chooses the sharing strategy."""
from __future__ import annotations

import os
import runpy
import sys

from .install import ENV_VAR, install

USAGE = "usage: python -m fastloader.launch (SCRIPT | -m MODULE) [ARGS...]"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr if argv[:1] != ["-h"] else sys.stdout)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    strategy = os.environ.get(ENV_VAR, "").strip()
    install(strategy if strategy in ("file_descriptor", "file_system") else "file_descriptor")
    if argv[0] == "-m":
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))   # as `python script`
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
