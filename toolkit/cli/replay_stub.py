"""The `replay` console script: the harness arrives with the replay issue."""

import sys


def main() -> None:
    sys.stderr.write(
        "replay: the replay harness is not part of this release yet; it arrives with\n"
        "the pools/replay issue. Compile a plan now with `moetrace plan compile`.\n"
    )
    sys.exit(2)
