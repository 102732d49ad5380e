"""For test_dropin_harness.py: ``python _hangs_once_script.py MODE OUT``. Its
first run in a directory hangs; every later run puts the result the test saved
beside OUT (``saved-result.pt``) in OUT and exits. It never imports torch, so that
a run takes a Python start-up and the test's timeout can be short."""
import os
import shutil
import sys
import time


def main():
    out = sys.argv[2]
    flag = os.path.join(os.path.dirname(out), "ran-once")
    if not os.path.exists(flag):
        open(flag, "w").close()
        time.sleep(3600)
    shutil.copy(os.path.join(os.path.dirname(out), "saved-result.pt"),
                os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
