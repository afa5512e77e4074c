"""The probes' CO-RE C sources (probes/<name>.bpf.c, shared parts in moetrace.bpf.h) and, under
build/, their objects compiled once by scripts/build-probes.sh."""

from pathlib import Path

#: where probes/<name>.bpf.c live (installed as package data of moetrace.probes)
PROBES_DIR = Path(__file__).resolve().parent
