"""Cache simulations over a plan.bin in bounded memory.

:func:`moetrace.analyses.sim.compute_sim` holds the whole access stream (11
bytes per read, more in temporaries); a plan of a million tokens of a
production model is 1.5 G reads. :func:`compute_sim_stream` gives the same
table from a plan read chunk by chunk (``chunk_reads`` reads at a time): the
streaming driver of the one simulator, :func:`moetrace.analyses.sim.simulate_source`,
whose every kernel carries its state between chunks (O(experts), not O(reads)):

* LRU, every budget: one stack-distance pass (Mattson) per scope;
* LFU: one heap per budget, in the same forward pass;
* static: access counts per expert (whole stream, warm window, scored window)
  in the same pass, then the table's hits from the counts;
* Belady: next uses come from the future, so a backward pass over the scored
  window writes them to a memory-mapped file (8 bytes per scored read, in
  ``TMPDIR``, removed when the source closes); the warm state comes from the
  forward pass; a last forward pass over the scored window runs MIN at every
  budget at once (the global scope's caches as bitmaps of next-use times, a bit
  per scored read and budget, in such files too).

Memory: one chunk of accesses plus the kernels' state and the plan's index
(8 bytes per iteration).
"""

from __future__ import annotations

import os
import tempfile
from typing import Sequence

import numpy as np
import pandas as pd

from moetrace.analyses.sim import POLICIES, simulate_source
from moetrace.inputs.trace import Accesses

DEFAULT_CHUNK_READS = 1 << 18


class PlanSource:
    """A plan read as chunks of whole iterations (global access indices kept): a source of
    :func:`moetrace.analyses.sim.simulate_source` (see :class:`~moetrace.analyses.sim.ArraySource`)."""

    def __init__(self, path: str | os.PathLike, chunk_reads: int = DEFAULT_CHUNK_READS):
        from moetrace.inputs.plan import PlanReader

        self.path = os.fspath(path)
        self.reader = PlanReader(self.path)
        h = self.reader.header
        self.header = h
        self.n_layers, self.n_experts, self.n_iterations = h.n_layers, h.n_experts, h.n_iterations
        self.order = h.order
        self.offsets = np.zeros(h.n_iterations + 1, np.int64)  # global index of each iteration's first read
        np.cumsum(self.reader.iteration_reads(), out=self.offsets[1:])
        self.n_accesses = int(self.offsets[-1])
        self.chunk_reads = max(1, int(chunk_reads))
        self._spills: list[str] = []

    def close(self) -> None:
        self.reader.close()
        for path in self._spills:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._spills.clear()

    def __enter__(self) -> "PlanSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, iteration: int) -> int:
        """The global index of the iteration's first read."""
        return int(self.offsets[iteration])

    def ranges(self, start: int = 0, stop: int | None = None) -> list[tuple[int, int]]:
        """Iteration ranges [a, b) of at most chunk_reads reads (at least one iteration each)."""
        stop = self.n_iterations if stop is None else stop
        out = []
        a = start
        while a < stop:
            b = int(np.searchsorted(self.offsets, self.offsets[a] + self.chunk_reads, side="right")) - 1
            b = min(max(b, a + 1), stop)
            out.append((a, b))
            a = b
        return out

    def chunk(self, a: int, b: int) -> tuple[int, Accesses]:
        """(global index of the first read, the accesses of iterations [a, b))."""
        L = self.n_layers
        its, ps, lays, exs = [], [], [], []
        for p in self.reader.passes(a, b):
            c = p.counts.astype(np.int64)
            n = int(c.sum())
            its.append(np.full(n, p.iteration, np.int32))
            ps.append(np.full(n, p.pass_index, np.int8))
            lays.append(np.repeat(np.arange(L, dtype=np.int16), c))
            exs.append(p.experts.astype(np.int32))
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))  # noqa: E731
        acc = Accesses(cat(its, np.int32), cat(ps, np.int8), cat(lays, np.int16), cat(exs, np.int32), L,
                       self.n_experts, b, self.order)
        return int(self.offsets[a]), acc

    def scratch(self, n: int) -> np.ndarray:
        """n zeroed int64 in a memory-mapped file in TMPDIR, removed on close: Belady's next uses
        (8 bytes per scored read) and the global scope's bitmaps of next-use times (a bit per
        scored read and budget)."""
        fd, tmp = tempfile.mkstemp(prefix="moetrace-nextuse-", suffix=".i64")
        os.close(fd)
        self._spills.append(tmp)
        return np.memmap(tmp, dtype=np.int64, mode="w+", shape=(max(int(n), 1),))


def compute_sim_stream(path: str | os.PathLike, policies: Sequence[str] = POLICIES,
                       budgets: Sequence[int] = (8, 16, 32, 64), scopes: Sequence[str] = ("per_layer",),
                       global_budgets: Sequence[int] | None = None, warm_fraction: float = 0.6,
                       expert_bytes: int | None = None, static_table: str | Accesses = "oracle",
                       static_table_name: str | None = None, chunk_reads: int = DEFAULT_CHUNK_READS,
                       progress=None) -> pd.DataFrame:
    """compute_sim's table for a plan file, in bounded memory (module docstring)."""
    with PlanSource(path, chunk_reads) as src:
        return simulate_source(src, policies, budgets, scopes, global_budgets, warm_fraction, expert_bytes,
                               static_table, static_table_name, progress)
