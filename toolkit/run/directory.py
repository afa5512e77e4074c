"""The run directory: the contract between recording and analysis (docs/run-directory.md).

Layout (schema ``moetrace.run/1``)::

    RUN_DIR/                 mode 0700 (owner only); every file 0600
      manifest.json          schema, toolkit_version, command, complete, exit_status,
                             plan / pool identity, kernel release and BTF, MGLRU state,
                             attach_plan, clock, lost, probe stats, timings, notes,
                             interval (armed/disarmed ns), detach (releaser_pid: the
                             process finishing the kernel's release; waited or not)
      experts.parquet        one row per expert + one "unattributed" row: pagecache columns
                             (added/evicted/re-added/requested/hit pages) and block columns
                             (device_read_bytes, bios; NA when the probe was not recorded)
      block_latency.parquet  block: read request latency log2 histogram of the pool's disk
      block_device.parquet   block: per-device bytes, bios, issues, requeues, completions,
                             the /proc/diskstats read delta over the probe's window
      reclaim.parquet        reclaim: one row per reclaimer kind (memcg, direct, kswapd, other)
      reclaim_histogram.parquet  reclaim: log2 ns durations of completed invocations per kind
      snapshots.json         /proc snapshots pre/post; pool_disk: the pool disk's diskstats
                             right after the block probe attached / right before it detached
      epochs.parquet         pagecache: one row per epoch (setup, each replay iteration, after)
      expert_epochs.parquet  pagecache: nonzero (epoch, expert) added/evicted/re-added pages
      page_events.parquet    (only with the per-page stream) one row per (event, expert piece)
      stream_intervals.parquet  per-interval record and lost counts of the stream
      lru.parquet, lru_dwell_histogram.parquet      lru: insertions, activations, dwell per expert
      reads.parquet, reads_latency.parquet, reads_files.parquet (read_calls.parquet with the stream)
                             reads: per read call classes (hit-only / miss / error), per expert
      mlock.parquet, mlock_timeline.parquet         mlock: calls and locked bytes over time
      stacks.parquet, stacks.folded                 stacks: symbolized cpu-clock samples
      lru_gen.parquet        mglru: <debugfs>/lru_gen samples (MGLRU kernels only)
      replay/                the replay's own iteration log (iterations.parquet, replay.json)

The manifest is written first with ``"complete": false`` and rewritten at the
end, so an interrupted or killed recording stays loadable and says so.
Analyses read a run with :func:`moetrace.open_run` (the one public reader,
:mod:`moetrace.run.handle`), without root. Readers accept every
schema version up to :data:`RUN_SCHEMA_VERSION`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import stat
from pathlib import Path
from typing import Any, cast

from moetrace.lazyimport import pandas as pd

from moetrace.version import __version__
from moetrace.atomic import atomic_write
from moetrace.errors import InputError, UsageError
from moetrace.jsonutil import json_default
from moetrace.run.documents import RUN_SCHEMA, RUN_SCHEMA_VERSION, Manifest

MANIFEST = "manifest.json"
REPLAY_SUBDIR = "replay"
DIR_MODE = 0o700
FILE_MODE = 0o600


def default_run_dir(base: str | os.PathLike = "runs") -> Path:
    """runs/<UTC timestamp>-<pid>: unique per recording."""
    ts = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(base) / f"{ts}-{os.getpid()}"


def create_run_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (parents as needed) readable by its owner only (0700).

    An existing directory is accepted only when empty (it is then chmod-ed to
    0700); one that holds anything refuses, so a recording never mixes with an
    older one."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{p} exists and is not a directory", hint="choose another --out")
        if any(p.iterdir()):
            raise UsageError(f"run directory {p} is not empty", hint="choose a new --out (or remove the old run)")
    else:
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(p, DIR_MODE)
    os.chmod(p, DIR_MODE)  # mkdir's mode is masked by the umask; chmod is not
    return p


def write_manifest(run_dir: str | os.PathLike, doc: Manifest, pretty: bool = True) -> Path:
    """The one writer of manifest.json (declared by :class:`moetrace.run.documents.Manifest`): write it atomically (0600); fills schema and toolkit_version. ``pretty=False``:
    on one line, by the json module's C encoder (a recording's intermediate writes: ~8x faster
    than the indented form, which the pure-Python encoder writes)."""
    doc = dict(doc)
    doc.setdefault("schema", f"{RUN_SCHEMA}/{RUN_SCHEMA_VERSION}")
    doc.setdefault("schema_version", RUN_SCHEMA_VERSION)
    doc.setdefault("toolkit_version", __version__)
    path = Path(run_dir) / MANIFEST
    text = json.dumps(doc, indent=1 if pretty else None, default=json_default, sort_keys=False) + "\n"
    with atomic_write(path, mode=FILE_MODE) as tmp:
        tmp.write_text(text)
    return path


def write_table(run_dir: str | os.PathLike, name: str, df: pd.DataFrame) -> Path:
    """Write ``<name>.parquet`` atomically (0600)."""
    path = Path(run_dir) / f"{name}.parquet"
    with atomic_write(path, mode=FILE_MODE) as tmp:
        df.to_parquet(tmp, index=False)
    return path


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """A JSON file's document; InputError naming the file (and the line, or the byte offset of
    text that is not UTF-8) when it cannot be read or parsed."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read the {what}: {e.strerror}", path=str(path)) from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(f"{what} is not UTF-8 text (byte {raw[e.start]:#04x})", path=str(path),
                         offset=e.start) from None
    except json.JSONDecodeError as e:
        raise InputError(f"{what} is not valid JSON ({e.msg})", path=str(path), line=e.lineno) from None
    except RecursionError:
        raise InputError(f"{what} nests too deep to be JSON moetrace wrote", path=str(path)) from None


def read_table(path: str | os.PathLike, name: str | None = None, manifest: Manifest | None = None,
               **kw) -> pd.DataFrame:
    """A Parquet table of a run; InputError naming the file for anything pyarrow or pandas
    cannot read (truncation, damaged pages, footer or pandas metadata) and for a table that
    decodes but is not what its readers need (:func:`moetrace.run.validate.check_table`:
    columns, keys, expert ids inside the geometry of ``manifest``)."""
    from moetrace.run.validate import check_table

    path = Path(path)
    name = name or path.stem
    try:
        df = pd.read_parquet(path, **kw)
    except Exception as e:  # noqa: BLE001 - pyarrow and pandas raise many types for a damaged file
        raise InputError(f"cannot read table {name!r}: {type(e).__name__}: {e}".strip(), path=str(path)) from None
    if "columns" not in kw:
        check_table(name, df, str(path), manifest)
    return df


def read_manifest(run_dir: str | os.PathLike) -> Manifest:
    """The one reader of manifest.json (:class:`moetrace.run.documents.Manifest`); refuses
    unknown schemas and newer versions, and values of the wrong type where analyses read them
    (:mod:`moetrace.run.validate`)."""
    from moetrace.run.validate import check_manifest

    path = Path(run_dir) / MANIFEST
    try:
        doc = read_json(path, "run manifest")
    except InputError as e:
        if e.line is None and e.offset is None:
            e.message += "\n  hint: is this a run directory made by `moetrace record`?"
        raise
    if not isinstance(doc, dict):
        raise InputError(f"not a moetrace run manifest (a JSON {type(doc).__name__}, not an object)",
                         path=str(path))
    schema = str(doc.get("schema", ""))
    name, _, ver = schema.partition("/")
    if name != RUN_SCHEMA or not ver.isdigit():
        raise InputError(f"not a moetrace run manifest (schema {schema!r})", path=str(path))
    if int(ver) > RUN_SCHEMA_VERSION:
        raise InputError(f"run schema version {ver} is newer than this moetrace reads ({RUN_SCHEMA_VERSION})",
                         path=str(path), hint="upgrade moetrace")
    upgrade_renamed_keys(doc)
    check_manifest(doc, str(path))
    return cast(Manifest, doc)


#: manifest keys an older moetrace wrote under another name: {old: new} per section
#: ("timings": the suffix of ``<probe>_...``); nothing is compiled at record time, so the
#: compile_* names went (issue 33)
RENAMED_KEYS: dict[str, dict[str, str]] = {
    "timings": {"_compile_attach_s": "_load_attach_s"},
    "attach_plan.*": {"compiled_out": "switched_off"},
    "summaries.block": {"compile_s": "load_s"},
    "summaries.reclaim": {"compile_s": "load_s"},
    "summaries.reads": {"compile_attach_s": "load_attach_s"},
}


def upgrade_renamed_keys(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a run manifest, changed in place) with the keys of :data:`RENAMED_KEYS` under
    their current names, so that every reader sees one vocabulary in old and new runs alike."""
    def rename(d: Any, pairs: dict[str, str], suffix: bool = False) -> None:
        if not isinstance(d, dict):
            return
        for key in list(d):
            for old, new in pairs.items():
                if (key.endswith(old) if suffix else key == old):
                    renamed = key[: len(key) - len(old)] + new
                    d.setdefault(renamed, d[key])
                    del d[key]
    rename(doc.get("timings"), RENAMED_KEYS["timings"], suffix=True)
    plans = doc.get("attach_plan") if isinstance(doc.get("attach_plan"), dict) else {}
    for plan in plans.values():
        rename(plan, RENAMED_KEYS["attach_plan.*"])
    summaries = doc.get("summaries") if isinstance(doc.get("summaries"), dict) else {}
    for probe in ("block", "reclaim", "reads"):
        rename(summaries.get(probe), RENAMED_KEYS[f"summaries.{probe}"])
    return doc


def is_private(path: str | os.PathLike) -> bool:
    """True when ``path`` grants nothing to group or others."""
    return stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
