"""`make leakcheck`: run benchmarks.loopback (every C path, both ends of a channel in
one process) under valgrind and fail on any leak or memory error that has a frame
in fastloader's C core. CPython, NumPy and torch have their own known reports at
exit; only ours count."""
import re
import subprocess
import sys

OURS = re.compile(r"_core\.cpython|csrc/")   # channels, codec and packed arrays


def blocks(log: str):
    """Valgrind reports as blocks of lines separated by a bare '==pid== ' line."""
    block = []
    for line in log.splitlines():
        body = re.sub(r"^==\d+== ?", "", line)
        if body.strip() == "":
            if block:
                yield block
            block = []
        else:
            block.append(body)
    if block:
        yield block


def main() -> int:
    cmd = ["valgrind", "--leak-check=full", "--show-leak-kinds=definite",
           "--num-callers=40", sys.executable, "-m", "benchmarks.loopback"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={"PYTHONMALLOC": "malloc", "PATH": "/usr/bin:/bin"})
    if "loopback ok" not in proc.stdout:
        print(proc.stdout, proc.stderr[-4000:])
        print("leakcheck: the loopback driver did not finish")
        return 2
    ours = [b for b in blocks(proc.stderr)
            if any(OURS.search(line) for line in b)
            and any(k in b[0] for k in ("definitely lost", "Invalid", "uninitialised",
                                         "Mismatched", "overlap"))]
    for b in ours:
        print("\n".join(b), end="\n\n")
    summary = [l for l in proc.stderr.splitlines() if "definitely lost:" in l]
    print(f"leakcheck: {len(ours)} report(s) in fastloader's C core "
          f"(whole process: {summary[-1].split('==')[-1].strip() if summary else 'n/a'})")
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main())
