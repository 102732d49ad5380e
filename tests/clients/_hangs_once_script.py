"""For test_dropin_harness.py: ``python _hangs_once_script.py MODE OUT``. Its
first run in a directory hangs (before importing torch, so that it is quick to
start); every later run saves an empty result and exits."""
import os
import sys
import time


def main():
    out = sys.argv[2]
    flag = os.path.join(os.path.dirname(out), "ran-once")
    if not os.path.exists(flag):
        open(flag, "w").close()
        time.sleep(3600)
    import torch

    torch.save({"ranks": []}, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
