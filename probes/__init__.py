"""The bcc C sources of the probes (one file per probe, shared parts in moetrace.h)."""

from pathlib import Path

#: where probes/<name>.c live (installed as package data of moetrace.probes)
PROBES_DIR = Path(__file__).resolve().parent
