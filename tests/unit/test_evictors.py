"""Who evicted a pool page: the pagecache probe's evictor classes (probes/moetrace.bpf.h EVICTOR_*) (unit tier)."""

from __future__ import annotations

from common.evictors import *  # noqa: F401,F403


def test_evictor_classes_match_the_header():
    text = (PROBES_DIR / "moetrace.bpf.h").read_text()
    got = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define EVICTOR_([A-Z_]+) (\d+)", text)}
    assert list(got) == list(EVICTORS) and list(got.values()) == list(range(len(EVICTORS)))
    assert int(re.search(r"#define N_EVICTORS (\d+)", text).group(1)) == len(EVICTORS)
    spec = PROBES["pagecache"]
    cols = [c.name for c in spec.schema if c.name.startswith("evicted_by_")]
    assert cols == [f"evicted_by_{e}_pages" for e in EVICTORS]
    assert [c.name for c in spec.tables()["epochs"] if c.name.startswith("evicted_by_")] == cols
