"""`make gpu`: every GPU test and benchmark in one call, a short table last.

Runs on the GPU machine with its preinstalled packages (installs nothing).
"""

from __future__ import annotations

import subprocess
import sys


def main() -> int:
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"])
    print(f"\nGPU tests: {'passed' if rc == 0 else f'FAILED (pytest exit {rc})'}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
