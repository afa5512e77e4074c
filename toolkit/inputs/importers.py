"""Importers: router traces from other tools into engine records.

Each reader yields :class:`moetrace.inputs.trace.Record` objects (step, layer,
experts, line, offset) in engine order, so :func:`moetrace.inputs.trace.type_records`
types them and :func:`moetrace.inputs.trace.write_jsonl` writes engine JSONL.
:func:`import_trace` runs a reader, drops placeholder layers and the leading
warm-up block, and returns the records with an account of what it did.

Formats, and where each was pinned down (public sources; no code copied):

``csv`` / ``parquet`` (and ``llamacpp`` CSV)
    A table with a header, one row per selected expert: a step column
    (``step``, ``token``, ``pos``, ``tok``, ``token_idx``, ``token_index``,
    ``iteration``; ``token_id`` is a vocabulary id and is *not* accepted), a
    layer column (``layer``, ``il``, ``layer_id``, ``layer_idx``, ``blk``) and
    an expert column (``expert``, ``expert_id``, ``expert_idx``,
    ``expert_index``, ``selected_expert``); optional ``rank`` (or ``slot``,
    ``topk_idx``, ``k_idx``: order within the record), ``weight`` (or
    ``prob``, ``score``: without a rank column, the record's experts are put in
    descending weight order, which is rank order) and ``pass`` (0/1: a
    fallback pass of a failed speculation). Without either, file order is
    taken as rank order. Names are case-insensitive. Instead of one expert per
    row, a list column ``experts`` / ``topk_ids`` / ``expert_ids`` (Parquet
    list, or a CSV cell ``"5 17 3"`` / ``"[5, 17, 3]"``) holds a record per
    row. Rows are grouped by (step, pass, layer) after a stable sort, so
    layer-major dumps work; a group of 2k rows is a speculative accept. With
    no layer column, ``--layers`` and ``--k`` split each step's rows in file
    order into layers of k (a step whose row count is not layers x k is an
    error). Delimiter: comma, tab, semicolon or whitespace, from the header.
    Integral floats (``5.0000``, as llama.cpp prints integers) are accepted.

``llamacpp``
    llama.cpp names the router's top-k tensor ``ffn_moe_topk-<il>``
    (``cb(selected_experts, "ffn_moe_topk", il)`` in ``build_moe_ffn``,
    ggerganov/llama.cpp ``src/llama-graph.cpp``; the callback formats
    ``"%s-%d"``). ``examples/eval-callback`` (ggerganov/llama.cpp
    ``examples/eval-callback/eval-callback.cpp`` and ``README.md``) prints
    every tensor as ``ggml_debug: <name> = (<type>) <OP>(...) = {ne0, ne1,
    ne2, ne3}`` followed by nested ``[ ... ]`` rows, values as ``%12.4f``;
    for ffn_moe_topk ne0 = k and ne1 = tokens of the micro-batch. The printer
    elides all but the first and last 3 entries of any dimension longer than
    6 (``...``), so a raw log is lossless only for k <= 6 and batches of <= 6
    tokens: that is why people convert the tensors to CSV (token, layer,
    expert). Both are accepted: a CSV as above, or a raw log (detected by
    ``ffn_moe_topk-`` header lines), where an elided row is an error naming
    the line. In a raw log, each token column of each ``ffn_moe_topk-<il>``
    tensor is one step for layer il, in order of appearance; micro-batches of
    more than one token are prompt processing (prefill) and are excluded
    unless ``include_prefill``.

``vllm``
    vLLM's routed-experts capture (``--enable-return-routed-experts``; PR
    vllm-project/vllm#28284, "recording expert indices for rollout router
    replay"): ``CompletionOutput.routed_experts`` is an int32 ``np.ndarray``
    shaped ``[seq_len, layer_num, topk]`` (vllm-project/vllm
    ``vllm/outputs.py``; captured per layer in
    ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` into a
    zero-filled (tokens, num_hidden_layers, num_experts_per_tok) buffer). The
    OpenAI-compatible server returns it per choice as a base64-encoded
    ``.npy`` (the routed-experts tests in vllm-project/vllm decode it with
    ``np.load(io.BytesIO(base64.b64decode(...)))``) with prompt_tokens +
    completion_tokens - 1 rows: the first prompt_tokens rows are the prompt
    (prefill), the rest one decode step each. Accepted: ``.npy`` (3-D, or 2-D
    (tokens x layers, k) with ``--layers``), ``.npz`` (key auto-detected or
    given; a scalar ``num_prompt_tokens`` / ``prompt_tokens`` or an array
    ``prompt_token_ids`` sets the prompt length), or the response ``.json``
    (``choices[0].routed_experts`` and ``usage.prompt_tokens``). A bare array
    carries no prompt length: pass ``prompt_tokens`` or every row is a step.
    Layers that are zero for every token (dense layers the capture never
    wrote, e.g. DeepSeek's first layers) are placeholders: dropped, and the
    MoE layers renumbered from 0 (the geometry presets count MoE layers).

``sglang``
    SGLang's expert distribution recorder (sgl-project/sglang
    ``python/sglang/srt/eplb/expert_distribution.py``, earlier
    ``python/sglang/srt/managers/expert_distribution.py``): started and dumped
    through ``/start_expert_distribution_record`` and
    ``/dump_expert_distribution_record``, mode from
    ``--expert-distribution-recorder-mode``, written with ``torch.save`` under
    ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``. Modes:

    * ``per_token``: ``{"records": [...], "last_physical_to_logical_map":
      (layers, physical experts)}``, one record per forward pass with
      ``forward_pass_id``, ``input_ids``, ``positions``, ``forward_mode``
      (SGLang's ForwardMode: 1 EXTEND, 2 DECODE, 3 MIXED, 4 IDLE) and
      ``topk_ids_of_layer`` (layers, tokens, 8) of physical expert ids, -1
      where unused (the gatherer's width is fixed at 8, DeepSeek's k). This is
      imported: one step per decode pass (a decode pass of several tokens is a
      batch of requests and an error), extend/mixed passes as prefill,
      physical ids mapped to logical ids, -1 slots dropped, all -1 layers
      dropped as placeholders.
    * ``per_pass``: the same records with only ``global_physical_count``
      (counts per pass) and ``stat`` / ``stat_approx``: ``logical_count``
      (buffered passes x layers x experts). Counts carry no token order, so no
      router trace can be built from them: an error that says so and points to
      ``moetrace trace stats --counts``.

    The ``.pt`` file (a zip of ``data.pkl`` plus raw storages) is read with a
    restricted unpickler that admits only tensor rebuilding and plain
    containers, so torch is not needed and no code in the file runs. Also
    accepted: a response ``.json`` of SGLang's ``--enable-return-routed-experts``
    (``meta_info.routed_experts``: base64 of the flattened int32 (tokens,
    layers, k) array, -1 for non-MoE layers, per the sgl-project/sglang-jax
    ``docs/features/return_routed_experts.md`` description of the feature it
    ports from SGLang PR #12162); it needs ``n_layers`` and ``k`` to reshape.

Warm-up junk (:func:`drop_warmup`): engines and hooks often log dummy passes
before real traffic (profiling and CUDA-graph capture run identical inputs),
which shows up as a block of steps whose routes -- every layer's expert set --
are identical, thousands of times. A leading block of at least
``min_repeats`` identical steps (default 16) is dropped, and the next block is
examined in turn; detection looks only at the start of the trace, so repeated
routing later on, and any repeat shorter than ``min_repeats`` (real decoding
does repeat a route for 2-3 steps), is kept.
"""

from __future__ import annotations

import base64
import collections
import io
import json
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

from moetrace.errors import InputError, UsageError
from moetrace.inputs.trace import Record

FORMATS = ("jsonl", "llamacpp", "vllm", "sglang", "csv", "parquet")
DEFAULT_WARMUP_MIN_REPEATS = 16
_MAX_ID = 2**62  # larger numbers are out of range for every id column (checked before the int64 cast)

STEP_NAMES = ("step", "token", "pos", "tok", "token_idx", "token_index", "iteration")
LAYER_NAMES = ("layer", "il", "layer_id", "layer_idx", "blk")
EXPERT_NAMES = ("expert", "expert_id", "expert_idx", "expert_index", "selected_expert")
EXPERTS_LIST_NAMES = ("experts", "topk_ids", "expert_ids")
RANK_NAMES = ("rank", "slot", "topk_idx", "k_idx")
WEIGHT_NAMES = ("weight", "prob", "score", "topk_weight")
PASS_NAMES = ("pass",)


@dataclass
class ImportResult:
    """Records in engine order plus what the import did (``stats``).

    ``rows`` holds, per record, how many source rows it came from (for the
    warm-up account). ``stats`` keys: format, rows_read, prefill_excluded,
    placeholder_layers_dropped, warmup (steps_dropped, rows_dropped, blocks),
    notes.
    """

    records: list[Record]
    rows: list[int]
    stats: dict = field(default_factory=dict)

    def n_layers(self, given: int | None) -> int | None:
        """The layer bound to type the records with, given the --layers the import was called with."""
        return self.stats.get("n_layers_for_typing", given)


# --------------------------------------------------------------------------- detection


def _read_head(path: str, n: int) -> bytes:
    """The first n bytes of a file (InputError naming it when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=path) from None


def detect_format(path: str | os.PathLike) -> str:
    """Guess the format from the extension and the first bytes.

    .npy/.npz -> vllm; .pt/.pth -> sglang; .parquet or PAR1 magic -> parquet;
    JSON Lines whose first line is an engine log line (meta / route) or a
    canonical record -> jsonl; .json -> vllm or sglang by its keys; text with ``ffn_moe_topk-`` header
    lines -> llamacpp; other text -> csv.
    """
    spath = str(path)
    try:
        with open(spath, "rb") as fh:
            head = fh.read(65536)
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=spath) from None
    ext = os.path.splitext(spath)[1].lower()
    if ext in (".npy", ".npz") or head.startswith(b"\x93NUMPY"):
        return "vllm"
    if ext in (".pt", ".pth"):
        return "sglang"
    if ext == ".parquet" or head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"PK\x03\x04"):
        # a zip: .npz or a torch.save archive
        return "sglang" if b"data.pkl" in head else "vllm"
    from moetrace.inputs.trace import UTF8_BOM

    text_head = head[len(UTF8_BOM):] if head.startswith(UTF8_BOM) else head
    if text_head.lstrip()[:1] == b"{":
        from moetrace.inputs.routelog import sniff

        if sniff(spath) is not None or ext in (".jsonl", ".ndjson"):
            return "jsonl"  # (a damaged first line: the JSON Lines readers name it)
    if ext == ".json" or text_head.lstrip()[:1] in (b"{", b"["):
        obj = _load_json(spath, want_extra=True)
        if obj is _JSONL:
            return "jsonl"
        return "sglang" if _find_sglang_json(obj) is not None else "vllm"
    if b"ffn_moe_topk-" in head:
        return "llamacpp"
    return "csv"


# --------------------------------------------------------------------------- tables


def _pick(cols: dict[str, str], names: Iterable[str]) -> str | None:
    for n in names:
        if n in cols:
            return cols[n]
    return None


def _sniff_sep(header: str) -> str:
    for sep in (",", "\t", ";"):
        if sep in header:
            return sep
    return r"\s+"


def _read_utf8(path: str, hint: str | None = None) -> str:
    """A whole text file as str: UTF-8 (a BOM allowed); UTF-16 or a byte that is not UTF-8
    is an InputError with its line, column and offset."""
    from moetrace.inputs.trace import UTF8_BOM, utf16_error

    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=path) from None
    err = utf16_error(data, path)
    if err is not None:
        raise err
    bom = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = e.start + bom
        col = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise InputError(f"not UTF-8 text: byte 0x{data[at]:02x} at column {col}", path=path,
                         line=data.count(b"\n", 0, at) + 1, offset=at, hint=hint) from None


def _read_csv_frame(path: str):
    """Read a CSV with a header into a DataFrame of strings plus the file line of each row."""
    import pandas as pd

    text = _read_utf8(path, hint="save the CSV as UTF-8")
    if "\0" in text:
        i = text.index("\0")
        raise InputError("a NUL byte in the text (not a CSV file?)", path=path, line=text.count("\n", 0, i) + 1)
    kept: list[str] = []
    lines: list[int] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        kept.append(raw)
        lines.append(lineno)
    if not kept:
        raise InputError("the file holds no header and no rows", path=path)
    sep = _sniff_sep(kept[0])
    try:
        df = pd.read_csv(io.StringIO("\n".join(kept)), sep=sep, dtype=str, keep_default_na=False,
                         skipinitialspace=True, engine="python" if sep == r"\s+" else "c")
    except Exception as e:  # pandas raises several parser error types
        # pandas counts the lines it was given (comments and blank lines dropped): name the file's line
        msg = str(e).split(". Error could possibly")[0]
        # ("line N" counts from 1, "row N" from 0, both over the lines pandas was given)
        m = re.search(r"\b(line|row) (\d+)", msg)
        at = (int(m.group(2)) - (m.group(1) == "line")) if m else 0
        line = lines[at] if 0 <= at < len(lines) else lines[0]
        msg = re.sub(r"\s*(in|at) (line|row) \d+|\s*line \d+,?", "", msg).replace("Error tokenizing data. C error: ",
                                                                                    "")
        raise InputError(f"cannot parse CSV: {msg}", path=path, line=line) from None
    if len(df) != len(kept) - 1:
        raise InputError(f"CSV parser read {len(df)} rows from {len(kept) - 1} lines (quoted newlines?)",
                         path=path)
    df.columns = [str(c).strip().lower() for c in df.columns]
    dup = sorted({c for c in df.columns if list(df.columns).count(c) > 1})
    if dup:
        raise InputError(f"the header names the column {dup[0]!r} twice (names are case-insensitive)", path=path,
                         line=lines[0])
    return df, np.asarray(lines[1:], dtype=np.int64), lines[0]


def _int_column(values, name: str, path: str, lines: np.ndarray | None, header_line: int | None,
                allow_negative: bool = False) -> np.ndarray:
    """Convert a column to int64, naming the first bad row (file line, or row number)."""
    import pandas as pd

    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        out = arr.astype(np.int64)
        bad = np.zeros(out.size, bool)
    else:
        if arr.dtype.kind == "f":
            num = arr.astype(np.float64)
        else:
            num = pd.to_numeric(pd.Series(arr, dtype=object).astype(str).str.strip(), errors="coerce").to_numpy(
                np.float64)
        bad = ~np.isfinite(num) | (num != np.round(num))
        with np.errstate(invalid="ignore"):
            huge = ~bad & (np.abs(num) > _MAX_ID)
        if huge.any():
            i = int(np.argmax(huge))
            raise InputError(f"column {name!r}: {str(arr[i]).strip()} is out of range (at most {_MAX_ID})",
                             path=path, **_loc(i, lines))
        out = np.where(bad, 0, num).astype(np.int64)
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(f"column {name!r}: {arr[i]!r} is not an integer", path=path,
                         **_loc(i, lines))
    if not allow_negative and (out < 0).any():
        i = int(np.argmax(out < 0))
        raise InputError(f"column {name!r}: negative value {out[i]}", path=path, **_loc(i, lines))
    return out


def _loc(i: int, lines: np.ndarray | None) -> dict:
    """Location kwargs for InputError: file line for CSV, nothing for Parquet (row is in the message)."""
    if lines is not None:
        return {"line": int(lines[i])}
    return {"hint": f"Parquet row {i} (0-based)"}


def _parse_list_cell(s: str, name: str, path: str, line: int | None, row: int) -> list[int]:
    body = s.strip().strip("[]()")
    parts = [p for p in re.split(r"[\s,;|]+", body) if p]
    out = []
    for p in parts:
        try:
            f = float(p)
        except ValueError:
            f = float("nan")
        if not np.isfinite(f) or f != int(f):
            raise InputError(f"column {name!r}: {p!r} is not an integer", path=path, line=line,
                             hint=None if line is not None else f"Parquet row {row} (0-based)")
        if f < 0:
            raise InputError(f"column {name!r}: negative expert {int(f)}", path=path, line=line,
                             hint=None if line is not None else f"Parquet row {row} (0-based)")
        out.append(int(f))
    if not out:
        raise InputError(f"column {name!r}: empty expert list", path=path, line=line,
                         hint=None if line is not None else f"Parquet row {row} (0-based)")
    return out


def read_table(path: str | os.PathLike, parquet: bool | None = None, n_layers: int | None = None,
               k: int | None = None, stats: dict | None = None) -> Iterator[tuple[Record, int]]:
    """Read a CSV or Parquet route table (module docstring) as (Record, source rows) pairs.

    Raises InputError naming the file and line (CSV) or row (Parquet) for
    missing columns, non-integer values, negative experts, or a step whose row
    count does not divide into ``n_layers`` layers of ``k``.
    """
    spath = str(path)
    if parquet is None:
        parquet = detect_format(spath) == "parquet"
    df, lines, header_line = _parquet_frame(spath) if parquet else _read_csv_frame(spath)
    cols = _table_columns(df, spath, header_line)
    n = len(df)
    if stats is not None:
        stats["rows_read"] = n
    if n == 0:
        return
    col = lambda c: _int_column(df[c].to_numpy(), c, spath, lines, header_line)  # noqa: E731
    step = col(cols["step"])
    c_pass = cols["pass"]
    ps = col(c_pass) if c_pass else np.zeros(n, np.int64)
    if c_pass and (ps > 1).any():
        i = int(np.argmax(ps > 1))
        raise InputError(f"column {c_pass!r}: pass must be 0 or 1, got {ps[i]}", path=spath, **_loc(i, lines))
    if cols["list"] is not None:
        experts_rows = _list_rows(df, cols["list"], spath, lines)
        if cols["layer"] is None:
            raise InputError(f"a list column {cols['list']!r} needs a layer column (" + "|".join(LAYER_NAMES)
                             + ")", path=spath, line=header_line)
        layer = col(cols["layer"])
        for i in np.lexsort((np.arange(n), layer, ps, step)):
            yield Record(int(step[i]), int(layer[i]), experts_rows[i],
                         int(lines[i]) if lines is not None else None, None), 1
        return
    expert = col(cols["expert"])
    rank = _table_rank(df, cols, col, n)
    if cols["layer"] is None:
        if not n_layers or not k:
            raise InputError("no layer column (" + "|".join(LAYER_NAMES) + ")", path=spath, line=header_line,
                             hint="add one, or pass --layers N and --k K to split each step's rows in file order")
        yield from _split_rows(step, expert, n_layers, k, spath, lines)
        return
    yield from _grouped_rows(step, ps, col(cols["layer"]), rank, expert, lines)


def _parquet_frame(spath: str) -> tuple:
    """(DataFrame with lower-case column names, None, None) of a Parquet table."""
    import pyarrow.parquet as pq

    try:
        tbl = pq.read_table(spath)
        df = tbl.to_pandas()
    except Exception as e:  # pyarrow raises several types for damaged files
        raise InputError(f"cannot read Parquet: {e}", path=spath) from None
    df.columns = [str(c).strip().lower() for c in df.columns]
    dup = sorted({c for c in df.columns if list(df.columns).count(c) > 1})
    if dup:
        raise InputError(f"the table names the column {dup[0]!r} twice (names are case-insensitive)", path=spath)
    return df, None, None


def _table_columns(df, spath: str, header_line: int | None) -> dict:
    """The table's step, layer, expert (or experts list), rank and pass columns (None: absent);
    InputError when the step or expert column is missing."""
    names = {c: c for c in df.columns}
    cols = {"step": _pick(names, STEP_NAMES), "layer": _pick(names, LAYER_NAMES),
            "expert": _pick(names, EXPERT_NAMES), "rank": _pick(names, RANK_NAMES),
            "pass": _pick(names, PASS_NAMES), "weight": _pick(names, WEIGHT_NAMES)}
    cols["list"] = _pick(names, EXPERTS_LIST_NAMES) if cols["expert"] is None else None
    missing = []
    if cols["step"] is None:
        missing.append("a step column (" + "|".join(STEP_NAMES) + ")")
    if cols["expert"] is None and cols["list"] is None:
        missing.append("an expert column (" + "|".join(EXPERT_NAMES + EXPERTS_LIST_NAMES) + ")")
    if missing:
        raise InputError("missing " + " and ".join(missing) + f"; the header has {list(df.columns)}",
                         path=spath, line=header_line,
                         hint="column names are case-insensitive; token_id is a vocabulary id, not a step")
    return cols


def _list_rows(df, c_list: str, spath: str, lines) -> list[list[int]]:
    """The experts of each row of a list column (a Parquet list or a CSV cell "5 17 3")."""
    experts_rows: list[list[int]] = []
    for i, v in enumerate(df[c_list].to_numpy()):
        ln = int(lines[i]) if lines is not None else None
        if isinstance(v, str):
            experts_rows.append(_parse_list_cell(v, c_list, spath, ln, i))
        else:
            items = np.asarray(v, dtype=object).reshape(-1).tolist() if v is not None else []
            experts_rows.append(_parse_list_cell(" ".join(str(x) for x in items), c_list, spath, ln, i))
    return experts_rows


def _table_rank(df, cols: dict, col, n: int) -> np.ndarray:
    """Each row's rank within its record: the rank column, else descending router weight (ties
    in file order), else file order."""
    if cols["rank"]:
        return col(cols["rank"])
    if cols["weight"]:
        import pandas as pd

        w = pd.to_numeric(pd.Series(df[cols["weight"]].to_numpy(), dtype=object).astype(str).str.strip(),
                          errors="coerce").to_numpy(np.float64)
        return np.where(np.isfinite(w), -w, 0.0)
    return np.arange(n)


def _split_rows(step: np.ndarray, expert: np.ndarray, n_layers: int, k: int, spath: str,
                lines) -> Iterator[tuple[Record, int]]:
    """A table without a layer column: each step's rows in file order are layer 0's k (or 2k)
    experts, then layer 1's, ..."""
    n = step.size
    order = np.lexsort((np.arange(n), step))
    s_sorted = step[order]
    bounds = np.flatnonzero(np.diff(s_sorted)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [n]])
    per = n_layers * k
    for a, b in zip(starts, ends):
        cnt = b - a
        if cnt % per:
            i = int(order[a])
            raise InputError(f"step {s_sorted[a]} has {cnt} rows, not divisible into {n_layers} layers of "
                             f"k={k} ({per} or {2 * per} rows)", path=spath, **_loc(i, lines))
        w = cnt // n_layers
        idx = order[a:b]
        for lay in range(n_layers):
            sel = idx[lay * w:(lay + 1) * w]
            yield Record(int(s_sorted[a]), lay, [int(x) for x in expert[sel]],
                         int(lines[sel[0]]) if lines is not None else None, None,
                         lines=[int(x) for x in lines[sel]] if lines is not None else None), int(w)


def _grouped_rows(step: np.ndarray, ps: np.ndarray, layer: np.ndarray, rank: np.ndarray, expert: np.ndarray,
                  lines) -> Iterator[tuple[Record, int]]:
    """One record per (step, pass, layer) group of rows (a stable sort: layer-major dumps work),
    its experts in rank order."""
    n = step.size
    order = np.lexsort((np.arange(n), rank, layer, ps, step))
    key = np.stack([step[order], ps[order], layer[order]])
    change = np.flatnonzero((np.diff(key, axis=1) != 0).any(axis=0)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [n]])
    ex_sorted = expert[order]
    for a, b in zip(starts, ends):
        i = int(order[a])
        row_lines = lines[order[a:b]] if lines is not None else None
        first_line = int(row_lines.min()) if row_lines is not None else None
        yield Record(int(step[i]), int(layer[i]), ex_sorted[a:b].tolist(), first_line, None,
                     lines=row_lines.tolist() if row_lines is not None else None), int(b - a)


# --------------------------------------------------------------------------- llama.cpp raw log

_LLAMA_HEAD = re.compile(r"ffn_moe_topk-(\d+)\s*(?:\([^)]*\)\s*)?=\s*\((\w+)\).*=\s*\{\s*(\d+),\s*(\d+),\s*(\d+),"
                         r"\s*(\d+)\s*\}\s*$")
_NUM = re.compile(r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


def is_llamacpp_log(path: str | os.PathLike) -> bool:
    """True when the file looks like llama-eval-callback output (ffn_moe_topk tensor headers)."""
    head = _read_head(str(path), 1 << 20)
    return any(_LLAMA_HEAD.search(ln.decode("utf-8", "replace")) for ln in head.splitlines()
               if b"ffn_moe_topk-" in ln)


def read_llamacpp_log(path: str | os.PathLike, include_prefill: bool = False,
                      stats: dict | None = None) -> Iterator[tuple[Record, int]]:
    """Read ffn_moe_topk-<il> tensors from a llama-eval-callback log (module docstring).

    Raises InputError with the line of an elided (``...``) or short tensor.
    """
    spath = str(path)
    try:
        with open(spath, "r", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=spath) from None
    routes: dict[int, dict[int, tuple[list[int], int]]] = collections.defaultdict(dict)
    tokens_seen: dict[int, int] = collections.defaultdict(int)
    prefill_tokens: dict[int, int] = collections.defaultdict(int)
    n_tensors = 0
    i, n = 0, len(lines)
    while i < n:
        m = _LLAMA_HEAD.search(lines[i]) if "ffn_moe_topk-" in lines[i] else None
        i += 1
        if m is None:
            continue
        head_line = i
        layer, typ = int(m.group(1)), m.group(2)
        ne = [int(m.group(g)) for g in (3, 4, 5, 6)]
        if typ not in ("i32", "i16", "i8", "i64"):
            raise InputError(f"ffn_moe_topk-{layer} has type {typ}, expected integer ids", path=spath,
                             line=head_line)
        kk, ntok = ne[0], ne[1] * ne[2] * ne[3]
        rows: list[list[int]] = []
        while i < n:
            s = lines[i].strip()
            if s.startswith("sum") or "ggml_debug" in s or "ffn_moe_topk-" in s or not s.startswith(("[", "]", ".")):
                break
            i += 1
            if "..." in s:
                raise InputError(f"ffn_moe_topk-{layer} ({kk} x {ntok}) is elided ('...') in the log",
                                 path=spath, line=i,
                                 hint="llama-eval-callback prints only the first and last 3 entries of a "
                                      "dimension longer than 6; dump ffn_moe_topk to CSV (token, layer, "
                                      "expert) instead")
            inner = s.strip("[], ")
            if inner and s.startswith("[") and not s.startswith("[["):
                rows.append([_as_int(v, spath, i) for v in _NUM.findall(inner)])
        if len(rows) != ntok or any(len(r) != kk for r in rows):
            raise InputError(f"ffn_moe_topk-{layer} declares {{{kk}, {ntok}}} but {len(rows)} rows of "
                             f"{sorted({len(r) for r in rows})} values were read", path=spath, line=head_line)
        n_tensors += ntok
        prefill = ntok > 1 and not include_prefill
        for r in rows:
            if prefill:
                prefill_tokens[layer] += 1
                continue
            t = tokens_seen[layer]
            tokens_seen[layer] += 1
            routes[t][layer] = (r, head_line)
    if stats is not None:
        stats["rows_read"] = n_tensors
        stats["prefill_excluded"] = int(max(prefill_tokens.values(), default=0))
        stats["prefill_unit"] = "tokens"
    for t in sorted(routes):
        for layer in sorted(routes[t]):
            ex, ln = routes[t][layer]
            yield Record(t, layer, ex, ln, None), 1


def _as_int(v: str, path: str, line: int) -> int:
    f = float(v)
    if not np.isfinite(f) or abs(f) > _MAX_ID:
        raise InputError(f"{v} is out of range for an expert id", path=path, line=line)
    if f != int(f):
        raise InputError(f"{v} is not an integer expert id", path=path, line=line)
    if f < 0:
        raise InputError(f"negative expert {int(f)}", path=path, line=line)
    return int(f)


# --------------------------------------------------------------------------- arrays (vLLM, SGLang)


def _load_json(path: str, want_extra: bool = False):
    """A JSON document (InputError with the line of what is wrong). want_extra: return the
    sentinel _JSONL instead of failing when a complete document is followed by more (JSON Lines)."""
    text = _read_utf8(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if want_extra and e.msg == "Extra data":
            return _JSONL
        raise InputError(f"not valid JSON ({e.msg} at column {e.colno})", path=path, line=e.lineno) from None
    except RecursionError:
        raise InputError("not valid JSON (nested too deeply)", path=path) from None


_JSONL = object()  # _load_json(want_extra=True): the file is JSON Lines, not one document


def _find_sglang_json(obj) -> dict | None:
    if isinstance(obj, list) and obj:
        obj = obj[0]
    if isinstance(obj, dict):
        mi = obj.get("meta_info")
        if isinstance(mi, dict) and "routed_experts" in mi:
            return mi
    return None


def _decode_b64_array(s, path: str, where: str) -> np.ndarray | bytes:
    if not isinstance(s, str):
        raise InputError(f"{where} is {type(s).__name__}, expected a base64 string", path=path)
    try:
        raw = base64.b64decode(s, validate=False)
    except (ValueError, TypeError) as e:
        raise InputError(f"{where} is not valid base64 ({e})", path=path) from None
    if raw.startswith(b"\x93NUMPY"):
        try:
            return np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy parses the header with ast: many error types
            raise InputError(f"{where}: bad .npy payload ({type(e).__name__}: {e})", path=path) from None
    return raw


def load_vllm_array(path: str | os.PathLike, key: str | None = None) -> tuple[np.ndarray, int | None, str]:
    """Load vLLM routed experts: (array, prompt tokens or None, where it came from)."""
    spath = str(path)
    if detect_format(spath) != "vllm" and not spath.endswith((".npy", ".npz", ".json")):
        raise InputError("not a .npy/.npz/.json routed-experts file", path=spath)
    head = _read_head(spath, 8)
    if head.lstrip()[:1] in (b"{", b"["):
        obj = _load_json(spath)
        if isinstance(obj, list):
            if len(obj) != 1:
                raise InputError(f"a list of {len(obj)} responses; import one response at a time", path=spath)
            obj = obj[0]
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if (not choices or not isinstance(choices, list) or not isinstance(choices[0], dict)
                or "routed_experts" not in choices[0]):
            raise InputError("no choices[0].routed_experts in the JSON", path=spath,
                             hint="start vLLM with --enable-return-routed-experts")
        if len(choices) > 1:
            raise InputError(f"{len(choices)} choices; import one completion at a time", path=spath)
        arr = _decode_b64_array(choices[0]["routed_experts"], spath, "choices[0].routed_experts")
        if isinstance(arr, bytes):
            raise InputError("choices[0].routed_experts is not a base64 .npy payload", path=spath)
        usage = obj.get("usage") or {}
        if not isinstance(usage, dict):
            raise InputError(f"usage is a {type(usage).__name__}, expected an object", path=spath)
        prompt = _prompt_count(usage.get("prompt_tokens"), spath, "usage.prompt_tokens")
        return arr, prompt, "choices[0].routed_experts"
    try:
        fh = open(spath, "rb")  # (ours to close: np.load of a path leaks it when a zip is damaged)
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=spath) from None
    with fh:
        try:
            loaded = np.load(fh, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy and zipfile raise many types for a damaged file
            raise InputError(f"cannot read numpy file ({e})", path=spath,
                             hint="object arrays are refused; save the routed experts as an int array") from None
        if isinstance(loaded, np.ndarray):
            return loaded, None, "array"
        # an .npz: a zip whose members are read (and may be damaged) one by one
        with loaded:
            try:
                return _npz_routes(loaded, spath, key)
            except (InputError, UsageError):
                raise
            except Exception as e:  # zipfile, zlib and numpy raise many types for a damaged member
                raise InputError(f"cannot read the .npz ({type(e).__name__}: {e})", path=spath) from None


def _npz_routes(loaded, spath: str, key: str | None) -> tuple[np.ndarray, int | None, str]:
    keys = list(loaded.files)
    if key is not None:
        if key not in keys:
            raise UsageError(f"{spath}: no array {key!r} in the .npz (it has {keys})")
        chosen = key
    else:
        arrays = {k_: loaded[k_] for k_ in keys}
        cands = [k_ for k_, a in arrays.items() if a.ndim in (2, 3) and a.dtype.kind in "iu"]
        named = [k_ for k_ in cands if any(s in k_.lower() for s in ("routed_experts", "topk", "expert"))]
        pick = named or cands
        if len(pick) != 1:
            raise InputError(f"cannot tell which array holds the routed experts (arrays: {keys})",
                             path=spath, hint="pass --key NAME")
        chosen = pick[0]
    arr = loaded[chosen]
    prompt = None
    for pk in ("num_prompt_tokens", "prompt_tokens", "prompt_len"):
        if pk in keys and loaded[pk].ndim == 0:
            v = loaded[pk]
            prompt = _prompt_count(v.item() if v.dtype.kind in "iub" else v.tolist(), spath, pk)
    if prompt is None and "prompt_token_ids" in keys:
        prompt = int(loaded["prompt_token_ids"].size)
    return arr, prompt, chosen


def _prompt_count(v, path: str, where: str) -> int | None:
    """A prompt length read from a file: None when absent, else a non-negative integer (InputError)."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) <= _MAX_ID:
        raise InputError(f"{where} is {str(v)[:40]}, not a token count", path=path)
    return int(v)


def _int_ids(arr: np.ndarray, path: str, where: str) -> np.ndarray:
    """An array of expert ids as int64: integral floats accepted, anything else (or an id out
    of range) an InputError naming its index."""
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            bad = np.argwhere(~np.isfinite(arr) | (arr != np.round(arr)))[0]
            raise InputError(f"{where}{list(map(int, bad))} = {arr[tuple(bad)]} is not an integer", path=path)
        mag = np.abs(arr.astype(np.float64))  # float16/32 cannot hold the bound itself
        if arr.size and mag.max() > _MAX_ID:
            bad = np.argwhere(mag > _MAX_ID)[0]
            raise InputError(f"{where}{list(map(int, bad))} = {arr[tuple(bad)]} is out of range", path=path)
        arr = arr.astype(np.int64)
    elif arr.dtype.kind not in "iu":
        raise InputError(f"{where} has dtype {arr.dtype}, expected integer expert ids", path=path)
    if arr.dtype.kind == "u" and arr.size and arr.max() > _MAX_ID:
        bad = np.argwhere(arr > _MAX_ID)[0]
        raise InputError(f"{where}{list(map(int, bad))} = {arr[tuple(bad)]} is out of range", path=path)
    return arr.astype(np.int64, copy=False)  # (native byte order; -1 placeholders fit)


def _as_tokens_layers_k(arr: np.ndarray, path: str, where: str, n_layers: int | None,
                        k: int | None) -> np.ndarray:
    """A 1-D (with n_layers and k) or 2-D (with n_layers) array reshaped to (tokens, layers, k)."""
    if arr.ndim == 1:
        if not n_layers or not k:
            raise InputError(f"{where} is a flat array of {arr.size} ids", path=path,
                             hint="pass --layers N and --k K to reshape it to (tokens, layers, k)")
        if arr.size % (n_layers * k):
            raise InputError(f"{where} holds {arr.size} ids, not divisible into {n_layers} layers x k={k}",
                             path=path)
        arr = arr.reshape(-1, n_layers, k)
    elif arr.ndim == 2:
        if not n_layers:
            raise InputError(f"{where} has rank 2 {arr.shape}; expected (tokens, layers, k)", path=path,
                             hint="pass --layers N if the rows are (token, layer) pairs in token-major order")
        if arr.shape[0] % n_layers:
            raise InputError(f"{where} has {arr.shape[0]} rows, not divisible into {n_layers} layers", path=path)
        if arr.shape[1] == 0:
            raise InputError(f"{where} has shape {arr.shape}: no experts per token", path=path)
        arr = arr.reshape(-1, n_layers, arr.shape[1])
    elif arr.ndim != 3:
        raise InputError(f"{where} has rank {arr.ndim} {arr.shape}; expected 3 (tokens, layers, k)", path=path)
    return arr


def records_from_array(arr: np.ndarray, path: str, where: str, *, n_layers: int | None = None,
                       k: int | None = None, prompt_tokens: int | None = None, include_prefill: bool = False,
                       placeholder: int | None = 0, stats: dict | None = None) -> Iterator[tuple[Record, int]]:
    """Records from a (tokens, layers, k) int array, one step per token row.

    A 2-D (tokens x layers, k) array needs ``n_layers``; a 1-D flat array needs
    ``n_layers`` and ``k``. The first ``prompt_tokens`` rows are prefill
    (excluded unless ``include_prefill``). Layers holding only ``placeholder``
    (0 for vLLM, -1 for SGLang) are dropped and the rest renumbered. Raises
    InputError naming the array index of a bad value.
    """
    arr = _int_ids(arr, path, where)
    if prompt_tokens is not None and prompt_tokens < 0:
        raise UsageError(f"--prompt-tokens must be >= 0, got {prompt_tokens}")
    reshaped = arr.ndim < 3
    arr = _as_tokens_layers_k(arr, path, where, n_layers, k)
    n_tok, n_lay, kk = arr.shape
    if k is not None and kk != k and placeholder != -1:
        raise InputError(f"{where} has k={kk} experts per token, but k={k} was given", path=path)
    if stats is not None:
        stats["rows_read"] = int(n_tok)
        stats["array_shape"] = list(arr.shape)
    keep = np.ones(n_lay, bool)
    if placeholder is not None and n_tok:
        keep = ~np.all(arr == placeholder, axis=(0, 2))
        if placeholder == 0 and kk == 1:
            keep[:] = True  # a zero column is a real choice when k == 1
        if not keep.any():
            raise InputError(f"every layer of {where} holds only {placeholder}", path=path,
                             hint="was routed-experts capture enabled for this request?")
    dropped = [int(i) for i in np.flatnonzero(~keep)]
    if stats is not None:
        stats["placeholder_layers_dropped"] = dropped
        # n_layers counted the array's layers when it reshaped a flat array; the typed trace has the rest
        stats["n_layers_for_typing"] = (n_lay - len(dropped)) if reshaped else n_layers
    kept_layers = np.flatnonzero(keep)
    sub = arr[:, kept_layers, :]
    if placeholder == -1:
        valid = sub != -1
    else:
        valid = np.ones(sub.shape, bool)
    neg = (sub < 0) & valid
    if neg.any():
        t, lj, j = np.argwhere(neg)[0]
        raise InputError(f"negative expert {sub[t, lj, j]} at {where}[{t}, {kept_layers[lj]}, {j}]", path=path)
    p = int(prompt_tokens or 0)
    if p > n_tok:
        raise InputError(f"prompt of {p} tokens but {where} has only {n_tok} rows", path=path)
    first = 0 if include_prefill else p
    if stats is not None:
        stats["prefill_excluded"] = 0 if include_prefill else p
        stats["prefill_unit"] = "tokens"
    body = sub[first:]
    srt = np.sort(np.where(valid[first:], body, -1), axis=2)
    dup = ((srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)).any(axis=2)
    empty = ~valid[first:].any(axis=2)
    for bad, what in ((empty, "no expert (only -1)"), (dup, "an expert appears twice")):
        if bad.any():
            t, lj = (int(x) for x in np.argwhere(bad)[0])
            row = body[t, lj][valid[first + t, lj]].tolist()
            raise InputError(f"{what} at {where}[{t + first}, {kept_layers[lj]}]: {row}", path=path)
    rows = body.tolist()
    padded = placeholder == -1
    for t, step_rows in enumerate(rows):
        for lj, row in enumerate(step_rows):
            yield Record(t, lj, [x for x in row if x != -1] if padded else row, None, None), int(lj == 0)


def read_vllm(path: str | os.PathLike, key: str | None = None, prompt_tokens: int | None = None,
              include_prefill: bool = False, n_layers: int | None = None, k: int | None = None,
              stats: dict | None = None) -> Iterator[tuple[Record, int]]:
    """vLLM routed experts (.npy / .npz / response .json) as records; see the module docstring."""
    spath = str(path)
    arr, prompt, where = load_vllm_array(spath, key)
    if prompt_tokens is None:
        prompt_tokens = prompt
    if stats is not None:
        stats["array"] = where
        if prompt_tokens is None and not include_prefill:
            stats.setdefault("notes", []).append(
                "the array carries no prompt length: every row was taken as a decode step "
                "(vLLM's routed experts include the prompt's rows; pass --prompt-tokens N)")
    yield from records_from_array(arr, spath, where, n_layers=n_layers, k=k, prompt_tokens=prompt_tokens,
                                  include_prefill=include_prefill, placeholder=0, stats=stats)


# --------------------------------------------------------------------------- SGLang (.pt without torch)

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_, "UntypedStorage": np.uint8,
}


class _StorageType:
    def __init__(self, name: str):
        self.name = name
        self.dtype = np.dtype(_STORAGE_DTYPES[name])


_MAX_EXPANDED = 1 << 24  # elements a stride-0 (expanded) tensor may have beyond its storage


def _rebuild_tensor(storage, storage_offset, size, stride, *rest):
    """A tensor as a numpy array copied out of its storage. Offset, size and stride come from
    the file: they are checked to stay inside the storage before any view is made (a damaged
    file must not read memory the storage does not own)."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise ValueError(f"a tensor's storage is a {type(storage).__name__}")
    arr = storage
    off = int(storage_offset)
    size = tuple(int(s) for s in size)
    stride = tuple(int(s) for s in stride) if stride is not None else None
    if off < 0 or any(s < 0 for s in size):
        raise ValueError(f"tensor offset {off} / size {list(size)} is negative")
    n = 1
    for s_ in size:
        n *= s_
    if not size:
        if off >= arr.size:
            raise ValueError(f"scalar at offset {off} past its storage of {arr.size}")
        return arr[off].copy()
    if stride is None:
        if off + n > arr.size:
            raise ValueError(f"tensor of {n} elements at offset {off} past its storage of {arr.size}")
        return arr[off:off + n].reshape(size).copy()
    if len(stride) != len(size) or any(s_ < 0 for s_ in stride):
        raise ValueError(f"tensor stride {list(stride)} does not fit size {list(size)}")
    if n == 0:
        return np.empty(size, arr.dtype)
    last = off + sum((sz - 1) * st for sz, st in zip(size, stride))
    if last >= arr.size:
        raise ValueError(f"tensor (offset {off}, size {list(size)}, stride {list(stride)}) reaches past its "
                         f"storage of {arr.size}")
    if n > max(arr.size, _MAX_EXPANDED):
        raise ValueError(f"tensor of {n} elements expands a storage of {arr.size}")
    view = np.lib.stride_tricks.as_strided(arr[off:], shape=size, strides=tuple(s_ * arr.itemsize for s_ in stride))
    return np.array(view)


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)


class _TorchZipUnpickler(pickle.Unpickler):
    """Loads a torch.save zip's data.pkl into numpy arrays and plain containers; refuses anything else."""

    _ALLOWED = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Size"): tuple,
        ("torch", "Tensor"): object,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
    }

    def __init__(self, fh, zf: zipfile.ZipFile, prefix: str, path: str):
        super().__init__(fh)
        self.zf, self.prefix, self.path = zf, prefix, path

    def find_class(self, module, name):
        if module == "__builtin__":  # protocol 2 names (torch.save uses protocol 2)
            module = "builtins"
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise InputError(f"the torch file references {module}.{name}, which this reader does not load",
                         path=self.path, hint="only tensors, lists, dicts and numbers are read (no code runs)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise InputError(f"unknown persistent id {pid!r:.60}", path=self.path)
        storage_type, key = pid[1], pid[2]
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else np.dtype(np.uint8)
        try:
            raw = self.zf.read(f"{self.prefix}/data/{key}")
        except KeyError:
            raise InputError(f"storage {key} missing from the archive", path=self.path) from None
        return np.frombuffer(raw, dtype=dtype.newbyteorder("<"))


def load_torch_file(path: str | os.PathLike):
    """Read a torch.save (zip) file without torch: tensors become numpy arrays."""
    spath = str(path)
    try:
        zf = zipfile.ZipFile(spath)
    except Exception as e:  # noqa: BLE001 - zipfile raises many types for a damaged archive
        raise InputError(f"not a torch.save zip archive ({type(e).__name__}: {e})", path=spath,
                         hint="files from torch < 1.6 (legacy format) are not supported") from None
    with zf:
        try:
            return _load_torch_zip(zf, spath)
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged archive or pickle raises many types
            raise InputError(f"damaged torch.save archive ({type(e).__name__}: {e})", path=spath) from None


def _load_torch_zip(zf: zipfile.ZipFile, spath: str):
    pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
    if not pkls:
        raise InputError("no data.pkl in the archive: not a torch.save file", path=spath)
    prefix = pkls[0][: -len("/data.pkl")] if "/" in pkls[0] else ""
    bo = [n for n in zf.namelist() if n.endswith("byteorder")]
    if bo and zf.read(bo[0]).strip() not in (b"little", b""):
        raise InputError("big-endian torch file", path=spath)
    with zf.open(pkls[0]) as fh:
        data = fh.read()
    try:
        return _TorchZipUnpickler(io.BytesIO(data), zf, prefix, spath).load()
    except InputError:
        raise
    except Exception as e:  # a damaged pickle raises many types
        raise InputError(f"cannot unpickle data.pkl ({type(e).__name__}: {e})", path=spath) from None


_SGLANG_DECODE, _SGLANG_EXTEND, _SGLANG_MIXED, _SGLANG_IDLE = 2, 1, 3, 4


def _int_array(v, where: str, path: str) -> np.ndarray:
    """A tensor (or nested list) of a dump as an int64 array of ids (InputError for anything else)."""
    try:
        arr = np.asarray(v)
    except (ValueError, TypeError) as e:
        raise InputError(f"{where} is not an array ({e})", path=path) from None
    if arr.dtype.kind not in "iu":
        raise InputError(f"{where} holds {arr.dtype} values, expected integer expert ids", path=path)
    if arr.dtype.kind == "u" and arr.size and arr.max() > _MAX_ID:
        raise InputError(f"{where} holds {arr.max()}, out of range", path=path)
    return arr.astype(np.int64, copy=False)


def _counts_error(path: str, what: str) -> InputError:
    return InputError(
        f"this SGLang dump holds {what}: counts have no token order, so no router trace can be built from it",
        path=path,
        hint="record with --expert-distribution-recorder-mode per_token for a trace, or feed the counts to "
             "`moetrace trace stats --counts`")


def read_sglang(path: str | os.PathLike, include_prefill: bool = False, n_layers: int | None = None,
                k: int | None = None, prompt_tokens: int | None = None,
                stats: dict | None = None) -> Iterator[tuple[Record, int]]:
    """SGLang expert-distribution per_token dump (.pt) or return_routed_experts response (.json)."""
    spath = str(path)
    head = _read_head(spath, 8)
    if head.lstrip()[:1] in (b"{", b"["):
        yield from _sglang_response(spath, include_prefill, n_layers, k, prompt_tokens, stats)
        return
    recs, p2l = _sglang_dump(spath)
    steps, prefill, skipped = _sglang_steps(recs, p2l, include_prefill, spath)
    if stats is not None:
        stats["passes_skipped"] = dict(skipped)
        if skipped.get("forward_mode 5", 0) or any(k_.startswith("forward_mode") for k_ in skipped):
            stats.setdefault("notes", []).append(
                "passes of other forward modes (speculative verify/draft) were skipped: " + str(dict(skipped)))
    if not steps:
        if stats is not None:
            stats["rows_read"] = len(recs)
        raise InputError(f"no decode passes among {len(recs)} records ({prefill} prefill tokens excluded)",
                         path=spath, hint="pass --include-prefill to take prompt tokens as steps")
    arr = np.stack(steps)  # (steps, layers, 8)
    sub_stats: dict = {}
    yield from records_from_array(arr, spath, "topk_ids_of_layer (stacked)", n_layers=None, k=None,
                                  prompt_tokens=0, include_prefill=True, placeholder=-1, stats=sub_stats)
    if stats is not None:
        stats.update({kk: v for kk, v in sub_stats.items() if kk not in ("prefill_excluded", "n_layers_for_typing")})
        stats["rows_read"] = len(recs)
        stats["rows_unit"] = "forward passes"
        stats["prefill_excluded"] = prefill
        stats["prefill_unit"] = "tokens"


def _sglang_response(spath: str, include_prefill: bool, n_layers: int | None, k: int | None,
                     prompt_tokens: int | None, stats: dict | None) -> Iterator[tuple[Record, int]]:
    """A return_routed_experts response: meta_info.routed_experts, base64 of int32s or of a .npy."""
    mi = _find_sglang_json(_load_json(spath))
    if mi is None:
        raise InputError("no meta_info.routed_experts in the JSON", path=spath,
                         hint="start SGLang with --enable-return-routed-experts and request "
                              "return_routed_experts")
    arr = _decode_b64_array(mi["routed_experts"], spath, "meta_info.routed_experts")
    if isinstance(arr, bytes):
        if len(arr) % 4:
            raise InputError(f"meta_info.routed_experts holds {len(arr)} bytes, not int32s", path=spath)
        arr = np.frombuffer(arr, dtype="<i4")
    pt = prompt_tokens if prompt_tokens is not None else _prompt_count(mi.get("prompt_tokens"), spath,
                                                                        "meta_info.prompt_tokens")
    yield from records_from_array(arr, spath, "meta_info.routed_experts", n_layers=n_layers, k=k,
                                  prompt_tokens=pt, include_prefill=include_prefill, placeholder=-1, stats=stats)


def _sglang_dump(spath: str) -> tuple[list, np.ndarray | None]:
    """(records, physical-to-logical map or None) of an expert_distribution_recorder .pt dump;
    InputError for a dump of counts only or of another shape."""
    obj = load_torch_file(spath)
    if not isinstance(obj, dict):
        raise InputError(f"unexpected SGLang dump: a {type(obj).__name__}, expected a dict", path=spath)
    if "logical_count" in obj and "records" not in obj:
        shape = getattr(obj["logical_count"], "shape", None)
        raise _counts_error(spath, "'stat' per-layer expert counts (logical_count"
                            + (f", shape {list(shape)})" if shape is not None else ")"))
    recs = obj.get("records")
    if not isinstance(recs, list):
        raise InputError(f"unexpected SGLang dump: keys {sorted(map(str, obj))}", path=spath,
                         hint="expected an expert_distribution_recorder_*.pt from /dump_expert_distribution_record")
    for ri, r in enumerate(recs):
        if not isinstance(r, dict):
            raise InputError(f"records[{ri}] is a {type(r).__name__}, expected a dict", path=spath)
    if recs and all("topk_ids_of_layer" not in r for r in recs):
        raise _counts_error(spath, "'per_pass' counts (global_physical_count per forward pass)")
    p2l = obj.get("last_physical_to_logical_map")
    p2l = _int_array(p2l, "last_physical_to_logical_map", spath) if p2l is not None else None
    if p2l is not None and p2l.ndim != 2:
        raise InputError(f"last_physical_to_logical_map has rank {p2l.ndim}; expected (layers, physical experts)",
                         path=spath)
    return recs, p2l


def _sglang_steps(recs: list, p2l: np.ndarray | None, include_prefill: bool,
                  spath: str) -> tuple[list[np.ndarray], int, collections.Counter]:
    """(each decode step's (layers, k) logical ids, -1 padded; prefill tokens excluded; passes
    skipped by reason) of a dump's records."""
    steps: list[np.ndarray] = []
    prefill = 0
    skipped: collections.Counter = collections.Counter()
    for ri, r in enumerate(recs):
        where = f"records[{ri}].topk_ids_of_layer"
        ids = _int_array(r.get("topk_ids_of_layer"), where, spath)
        if ids.ndim != 3:
            raise InputError(f"{where} has rank {ids.ndim}; expected (layers, tokens, k)", path=spath)
        mode = r.get("forward_mode", _SGLANG_DECODE)
        if isinstance(mode, bool) or not isinstance(mode, int):
            raise InputError(f"records[{ri}].forward_mode is {str(mode)[:40]}, expected an integer (SGLang's "
                             "ForwardMode)", path=spath)
        ntok = ids.shape[1]
        if mode == _SGLANG_IDLE or ntok == 0:
            skipped["idle"] += 1
            continue
        if steps and ids.shape[::2] != steps[0].shape:
            raise InputError(f"{where} has {ids.shape[0]} layers x k={ids.shape[2]}, an earlier record "
                             f"{steps[0].shape[0]} x k={steps[0].shape[1]}", path=spath)
        if p2l is not None:
            ids = _sglang_logical(ids, p2l, where, spath)
        if mode in (_SGLANG_EXTEND, _SGLANG_MIXED):
            if not include_prefill:
                prefill += ntok
                continue
            for t in range(ntok):
                steps.append(ids[:, t, :])
            continue
        if mode != _SGLANG_DECODE:
            skipped[f"forward_mode {mode}"] += 1
            continue
        if ntok != 1:
            raise InputError(f"records[{ri}] is a decode pass of {ntok} tokens (a batch of requests); the engine "
                             "trace holds one request", path=spath,
                             hint="record with one request in flight at a time")
        steps.append(ids[:, 0, :])
    return steps, prefill, skipped


def _sglang_logical(ids: np.ndarray, p2l: np.ndarray, where: str, spath: str) -> np.ndarray:
    """Physical expert ids (layers, tokens, k) mapped to logical ones (-1 stays -1)."""
    if p2l.shape[0] != ids.shape[0]:
        raise InputError(f"last_physical_to_logical_map has shape {list(p2l.shape)}, records have "
                         f"{ids.shape[0]} layers", path=spath)
    bad = (ids >= p2l.shape[1]) | (ids < -1)
    if bad.any():
        lay, t, j = np.argwhere(bad)[0]
        raise InputError(f"physical expert {ids[lay, t, j]} at {where}"
                         f"[{lay}, {t}, {j}] is outside the map ({p2l.shape[1]} physical experts)", path=spath)
    lay_idx = np.arange(ids.shape[0])[:, None, None]
    return np.where(ids >= 0, p2l[lay_idx, np.maximum(ids, 0)], -1)


# --------------------------------------------------------------------------- warm-up


def _step_groups(records: list[Record]) -> list[tuple[int, int]]:
    """(start, end) index ranges of consecutive records sharing a step."""
    out = []
    i, n = 0, len(records)
    while i < n:
        j = i + 1
        while j < n and records[j].step == records[i].step:
            j += 1
        out.append((i, j))
        i = j
    return out


def find_warmup(records: list[Record], min_repeats: int = DEFAULT_WARMUP_MIN_REPEATS) -> list[tuple[int, int]]:
    """Leading warm-up blocks as (first step index, step count): each a run of at least
    ``min_repeats`` steps whose routes (every record's layer and expert set, in
    order) are identical; blocks are looked for only at the start, one after
    another."""
    if min_repeats < 2:
        raise UsageError(f"--warmup-min-repeats must be at least 2, got {min_repeats}")
    groups = _step_groups(records)
    sig = [tuple((records[x].layer, frozenset(records[x].experts), len(records[x].experts)) for x in range(a, b))
           for a, b in groups]
    blocks = []
    s = 0
    while s < len(sig):
        e = s + 1
        while e < len(sig) and sig[e] == sig[s]:
            e += 1
        if e - s < min_repeats:
            break
        blocks.append((s, e - s))
        s = e
    return blocks


def drop_warmup(records: list[Record], rows: list[int], min_repeats: int = DEFAULT_WARMUP_MIN_REPEATS,
                path: str | None = None) -> tuple[list[Record], list[int], dict]:
    """Drop the leading warm-up blocks (:func:`find_warmup`).

    Returns (records, rows, info) with info = {steps_dropped, rows_dropped,
    records_dropped, blocks: [[first step, steps], ...]}. Raises InputError
    when every step would be dropped.
    """
    blocks = find_warmup(records, min_repeats)
    info = {"steps_dropped": 0, "rows_dropped": 0, "records_dropped": 0, "blocks": [], "min_repeats": min_repeats}
    if not blocks:
        return records, rows, info
    groups = _step_groups(records)
    n_steps = sum(c for _, c in blocks)
    if n_steps >= len(groups):
        raise InputError(f"all {len(groups)} steps are one identical route repeated (warm-up junk?)", path=path,
                         hint="pass --keep-warmup to import them anyway")
    cut = groups[n_steps][0]
    info.update(steps_dropped=n_steps, rows_dropped=int(sum(rows[:cut])), records_dropped=cut,
                blocks=[[int(records[groups[s][0]].step), int(c)] for s, c in blocks])
    return records[cut:], rows[cut:], info


# --------------------------------------------------------------------------- entry point


def import_trace(path: "str | os.PathLike | Sequence[str | os.PathLike]", fmt: str = "auto", *,
                 key: str | None = None, prompt_tokens: int | None = None, include_prefill: bool = False,
                 keep_warmup: bool = False, warmup_min_repeats: int = DEFAULT_WARMUP_MIN_REPEATS,
                 k: int | None = None, n_layers: int | None = None, max_batch: int | None = None
                 ) -> ImportResult:
    """Read ``path`` (several paths: per-layer JSON Lines logs) in format ``fmt``
    (or detect it) and drop the leading warm-up block.

    Returns an :class:`ImportResult`; type its records with
    ``type_records(result.records, k=..., n_layers=result.n_layers(n_layers), n_experts=...)``
    (``n_layers`` given to reshape a flat array counts its placeholder layers too), or call
    :func:`import_to_jsonl`, which also types and writes them (streamed when large).
    Raises InputError (file plus line, row or array index) for bad input and
    UsageError for an unknown format or contradicting options.
    """
    paths = [str(path)] if isinstance(path, (str, os.PathLike)) else [str(p) for p in path]
    _check_import_args(paths, k, n_layers, prompt_tokens, max_batch)
    stats: dict = {"format": fmt, "rows_read": 0, "prefill_excluded": 0, "placeholder_layers_dropped": []}
    fmt = _resolve_format(paths, fmt, stats, max_batch)
    if fmt == "jsonl":
        return _import_jsonl(paths, stats, include_prefill, keep_warmup, warmup_min_repeats, max_batch)
    spath = paths[0]
    it = _format_reader(spath, fmt, stats, key=key, prompt_tokens=prompt_tokens, include_prefill=include_prefill,
                        n_layers=n_layers, k=k)
    records: list[Record] = []
    rows: list[int] = []
    for rec, nr in it:
        records.append(rec)
        rows.append(nr)
    if keep_warmup:
        info = {"steps_dropped": 0, "rows_dropped": 0, "records_dropped": 0, "blocks": [], "kept": True,
                "candidates": [[int(s), int(c)] for s, c in find_warmup(records, warmup_min_repeats)]}
    else:
        records, rows, info = drop_warmup(records, rows, warmup_min_repeats, path=spath)
    stats["warmup"] = info
    stats.setdefault("notes", [])
    return ImportResult(records, rows, stats)


def _check_import_args(paths: list[str], k: int | None, n_layers: int | None, prompt_tokens: int | None,
                       max_batch: int | None) -> None:
    if not paths:
        raise UsageError("no trace to import")
    for name, v, lo in (("k", k, 1), ("layers", n_layers, 1), ("prompt-tokens", prompt_tokens, 0),
                        ("max-batch", max_batch, 1)):
        if v is not None and v < lo:
            raise UsageError(f"--{name} must be at least {lo}, got {v}")
    for p in paths:
        if not os.path.exists(p):
            raise InputError("no such file", path=p)
        if os.path.isdir(p):
            raise InputError("is a directory, not a trace", path=p)


def _resolve_format(paths: list[str], fmt: str, stats: dict, max_batch: int | None) -> str:
    """The format to read (``fmt``, or detected for auto; a JSON Lines log given as vllm or
    sglang is read as jsonl, with a note); UsageError when the options do not fit it."""
    spath = paths[0]
    detected = None
    if fmt == "auto" or fmt in ("vllm", "sglang", "jsonl"):
        detected = detect_format(spath)
    if fmt in ("vllm", "sglang") and detected == "jsonl":
        stats.setdefault("notes", []).append(f"{spath} is a JSON Lines engine log, read as --format jsonl")
        fmt = "jsonl"
    if fmt == "auto":
        fmt = detected
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)} or auto")
    stats["format"] = fmt
    if len(paths) > 1 and fmt != "jsonl":
        raise UsageError(f"several input files are read only as JSON Lines engine logs (one per layer); "
                         f"{spath} is {fmt}")
    if max_batch is not None and fmt != "jsonl":
        raise UsageError("--max-batch applies to JSON Lines engine logs only")
    return fmt


def _import_jsonl(paths: list[str], stats: dict, include_prefill: bool, keep_warmup: bool, min_repeats: int,
                  max_batch: int | None) -> ImportResult:
    """A canonical engine JSONL (one file) or engine routing logs (one or one per layer)."""
    from moetrace.inputs.routelog import read_route_log, sniff

    spath = paths[0]
    kinds = {p: sniff(p) for p in paths}
    if all(v == "engine" for v in kinds.values()) and len(paths) == 1:
        from moetrace.inputs.trace import read_jsonl

        st: dict = {}
        records = list(read_jsonl(spath, st))
        stats.update(rows_read=len(records), rows_unit="records", source="engine JSONL",
                     prefill_excluded=st.get("prefill_records", 0), prefill_unit="records")
        rows = [1] * len(records)
        info = {"steps_dropped": 0, "rows_dropped": 0, "records_dropped": 0, "blocks": []}
        if not keep_warmup:
            records, rows, info = drop_warmup(records, rows, min_repeats, path=spath)
        stats["warmup"] = info
        stats.setdefault("notes", [])
        return ImportResult(records, rows, stats)
    not_logs = [p for p, v in kinds.items() if v != "routelog"]
    if not_logs and not (len(paths) == 1 and kinds[spath] is None):
        raise InputError("not an engine routing log (its first line is no meta or route line)",
                         path=not_logs[0], hint="give every per-layer file of one run")
    if include_prefill:
        raise UsageError("--include-prefill does not apply to engine logs: a forward pass runs one token "
                         "per request, and prompt rows are not tokens of a step")
    stats["source"] = "engine routing log" + (f" ({len(paths)} files)" if len(paths) > 1 else "")
    stats["rows_unit"] = "route lines"
    records, rows = [], []
    for rec, nr in read_route_log(paths, min_repeats=min_repeats, keep_warmup=keep_warmup,
                                  max_batch=max_batch, stats=stats):
        records.append(rec)
        rows.append(nr)
    stats.setdefault("notes", [])
    return ImportResult(records, rows, stats)


def _format_reader(spath: str, fmt: str, stats: dict, *, key: str | None, prompt_tokens: int | None,
                   include_prefill: bool, n_layers: int | None, k: int | None) -> Iterator[tuple[Record, int]]:
    """The reader of a one-file format other than jsonl: (record, source rows) in engine order."""
    if fmt == "vllm":
        stats["rows_unit"] = "tokens"
        return read_vllm(spath, key=key, prompt_tokens=prompt_tokens, include_prefill=include_prefill,
                         n_layers=n_layers, k=k, stats=stats)
    if fmt == "sglang":
        stats["rows_unit"] = "tokens"
        return read_sglang(spath, include_prefill=include_prefill, n_layers=n_layers, k=k,
                           prompt_tokens=prompt_tokens, stats=stats)
    if fmt == "llamacpp" and is_llamacpp_log(spath):
        stats["source"] = "eval-callback log"
        stats["rows_unit"] = "ffn_moe_topk token rows"
        return read_llamacpp_log(spath, include_prefill=include_prefill, stats=stats)
    stats["rows_unit"] = "rows"
    return read_table(spath, parquet=(fmt == "parquet") if fmt != "llamacpp" else False,
                      n_layers=n_layers, k=k, stats=stats)


# --------------------------------------------------------------------------- import: read, type, write


@dataclass
class Imported:
    """What :func:`import_to_jsonl` wrote: the typed trace's figures and the import's account
    (``stats``: ImportResult.stats' keys)."""

    n_steps: int
    n_requests: int
    n_layers: int
    n_experts: int
    k: int
    accounting: dict
    stats: dict
    records_written: int


def import_to_jsonl(paths: "str | os.PathLike | Sequence[str | os.PathLike]", out: str | os.PathLike,
                    fmt: str = "auto", *, key: str | None = None, prompt_tokens: int | None = None,
                    include_prefill: bool = False, keep_warmup: bool = False,
                    warmup_min_repeats: int = DEFAULT_WARMUP_MIN_REPEATS, k: int | None = None,
                    n_layers: int | None = None, n_experts: int | None = None,
                    max_batch: int | None = None) -> Imported:
    """`trace import`: read a trace (:func:`import_trace`'s formats and options), type it with the
    canonical rules (validation and accounting) and write it to ``out`` as engine JSONL,
    atomically. A large canonical engine JSONL or engine routing log goes through the bounded-
    memory path (moetrace.inputs.stream); anything else, or anything that path cannot take,
    is read whole, so an error names the input's own line."""
    paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
    if fmt in ("auto", "jsonl", "vllm", "sglang") and not (include_prefill or key or prompt_tokens):
        done = _import_streamed(paths, out, keep_warmup, warmup_min_repeats, k, n_layers, n_experts, max_batch)
        if done is not None:
            return done
    from moetrace.inputs.trace import type_records, write_records

    res = import_trace(paths, fmt, key=key, prompt_tokens=prompt_tokens, include_prefill=include_prefill,
                       keep_warmup=keep_warmup, warmup_min_repeats=warmup_min_repeats, k=k, n_layers=n_layers,
                       max_batch=max_batch)
    tt = type_records(res.records, k=k, n_layers=res.n_layers(n_layers), n_experts=n_experts, path=paths[0])
    n = write_records(res.records, out)
    return Imported(tt.n_steps, tt.n_requests, tt.n_layers, tt.n_experts, tt.k, tt.accounting, res.stats, n)


def _import_streamed(paths: list[str], out, keep_warmup: bool, min_repeats: int, k: int | None,
                     n_layers: int | None, n_experts: int | None, max_batch: int | None) -> Imported | None:
    """A large canonical engine JSONL, or large engine routing logs, imported in bounded
    memory (validated chunk by chunk, warm-up dropped, written atomically), or None
    for the in-memory path (small input, other formats, or an error: the in-memory
    path then reports it with the input's own line)."""
    from moetrace.inputs import stream as S
    from moetrace.inputs.routelog import sniff

    kinds = {sniff(p) for p in paths}
    total = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
    if total <= S.stream_limit():
        return None
    if kinds == {"engine"} and len(paths) == 1 and max_batch is None:
        def engine(ts: S.TypedStream) -> tuple:
            info, n = S.write_engine_jsonl(ts, out, keep_warmup=keep_warmup, min_repeats=min_repeats)
            acc = ts.accounting()
            st = {"format": "jsonl", "source": "engine JSONL (streamed)", "rows_read": n + info["records_dropped"],
                  "rows_unit": "records", "prefill_excluded": acc.get("prefill_records_excluded", 0),
                  "prefill_unit": "records", "placeholder_layers_dropped": [], "warmup": info, "notes": []}
            return ts, acc, st, n

        if min_repeats < 2:
            raise UsageError(f"--warmup-min-repeats must be at least 2, got {min_repeats}")
        done = S.with_stream(paths[0], engine, k, n_layers, n_experts, force=True)
    elif kinds == {"routelog"}:
        done = _stream_route_log(paths, out, keep_warmup, min_repeats, k, n_layers, n_experts, max_batch)
    else:
        return None
    if done is None:
        return None
    ts, acc, st, n = done
    return Imported(acc["steps"], max(1, len(ts.requests)), ts.n_layers, ts.n_experts, ts.k, acc, st, n)


def _stream_route_log(paths: list[str], out, keep_warmup: bool, min_repeats: int, k: int | None,
                      n_layers: int | None, n_experts: int | None, max_batch: int | None) -> tuple | None:
    """Engine routing logs read into a temporary engine JSONL, typed chunk by chunk, moved onto out."""
    from moetrace.inputs import stream as S
    from moetrace.inputs.routelog import read_route_log
    from moetrace.inputs.trace import write_records

    st = {"format": "jsonl", "rows_read": 0, "prefill_excluded": 0, "placeholder_layers_dropped": [],
          "source": "engine routing log" + (f" ({len(paths)} files)" if len(paths) > 1 else "") + ", streamed",
          "rows_unit": "route lines"}
    tmp = f"{out}.tmp-{os.getpid()}.records"

    def typed(ts: S.TypedStream) -> S.TypedStream:
        for _ in ts.tables():
            pass
        return ts

    try:
        n = write_records((rec for rec, _ in read_route_log(paths, min_repeats=min_repeats, keep_warmup=keep_warmup,
                                                            max_batch=max_batch, stats=st)), tmp)
        # the log's own errors above name its line; the records' (k, --experts, ...) name a line of
        # the temporary file, so for those the in-memory path reads the log again and names its line
        try:
            ts = S.with_stream(tmp, typed, k, n_layers, n_experts, force=True)
        except InputError:
            return None
        if ts is None:
            return None
        ts.path = paths[0]
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    acc = ts.accounting()
    acc.pop("prefill_records_excluded", None)
    st.setdefault("notes", [])
    return ts, acc, st, n
