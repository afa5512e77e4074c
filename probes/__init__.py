"""The probes' CO-RE C sources (probes/<name>.bpf.c, shared parts in moetrace.bpf.h) and, under
build/, their objects compiled once by scripts/build-probes.sh. A wheel carries both (the sources
for reading, the objects to load): an installed moetrace needs neither clang nor bpftool."""

from pathlib import Path

#: where probes/<name>.bpf.c and build/<name>.bpf.o live (package data of moetrace.probes)
PROBES_DIR = Path(__file__).resolve().parent

#: scripts/build-probes.sh when this package runs from a checkout (an editable install), where an
#: object older than its source is stale; None when installed (a wheel's objects are as it built them)
_script = PROBES_DIR.parent / "scripts" / "build-probes.sh"
BUILD_SCRIPT: Path | None = _script if _script.is_file() else None
