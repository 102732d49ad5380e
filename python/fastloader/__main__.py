"""`python -m fastloader <command>`: command-line tools that ship with fastloader.

    python -m fastloader doctor [--json] [--clean] [--no-selftest]
"""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"doctor": "check sharing, /dev/shm, fd limits and start methods"}
    if not argv or argv[0] not in commands:
        usage = "\n".join(f"  {name:<8} {text}" for name, text in commands.items())
        print(f"usage: python -m fastloader <command> [options]\n\ncommands:\n{usage}",
              file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    # Imported here so that `--help` stays fast and other commands don't pay for it.
    from .doctor import main as doctor_main

    return doctor_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
