"""Imported only as the last module Python's forkserver preloads, when fastloader
started that server with SIGINT ignored while the program itself did not ignore
it (forkserver.py). The server's main() gives every process it forks the SIGINT
handler it has once its preloads are imported: this gives it Python's default
back first, so that the program's own forkserver processes take Ctrl-C as they
would without fastloader. Nothing else imports it."""
from .sigint import restore_default_in_forkserver

restore_default_in_forkserver()
