"""Names (no kernel): one program-name scheme in every declaration, the ``MOE_`` prefix on
every knob (the names pagecache's and lru's knobs had before still accepted from a user, with
a one-line notice naming the new one), and no compile vocabulary where nothing is compiled: the
manifest keys renamed (older runs read under the new names) and no product file speaking of
compiling a probe at record time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moetrace.errors import UsageError
from moetrace.record.probe import RecordContext
from moetrace.record.probes import PROBES, recorder_class
from moetrace.record.spec import AttachPlan, program_name

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "reports"


# -- program names ----------------------------------------------------------------------------

def test_every_declared_program_follows_the_scheme():
    bad = [f"{p}/{g.name}: {c.fn_name} (want {program_name(c.kind, c.target)})"
           for p, s in PROBES.items() for g in s.attach for c in g.candidates
           if c.fn_name != program_name(c.kind, c.target)]
    assert not bad, bad


def test_program_name_of_each_kind():
    assert program_name("tracepoint", "syscalls:sys_enter_read") == "tp_sys_enter_read"
    assert program_name("raw_tracepoint", "block:block_rq_issue") == "raw_block_rq_issue"
    assert program_name("kprobe", "inc_max_seq.constprop.0") == "kp_inc_max_seq_constprop_0"
    assert program_name("kretprobe", "vfs_read") == "kret_vfs_read"
    assert program_name("fentry", "folio_inc_gen") == "fe_folio_inc_gen"
    assert program_name("fexit", "folio_inc_gen") == "fx_folio_inc_gen"
    assert program_name("perf_event", "software:cpu-clock") == "pe_cpu_clock"
    assert program_name("debugfs", "lru_gen") == ""


# -- knob names -------------------------------------------------------------------------------

def test_every_knob_has_the_moe_prefix_and_old_names_are_unambiguous():
    for p, s in PROBES.items():
        names = [k.name for k in s.knobs]
        assert all(n.startswith("MOE_") and n == n.upper() for n in names), (p, names)
        assert len(set(names)) == len(names), p
        was = [k.was for k in s.knobs if k.was]
        assert len(set(was)) == len(was) and not set(was) & set(names), p
        assert all(k.name == "MOE_" + k.was for k in s.knobs if k.was), p
    assert sum(bool(k.was) for s in PROBES.values() for k in s.knobs) == 21


def test_knob_named_maps_an_old_name_with_a_notice():
    lru = PROBES["lru"]
    assert lru.knob_named("MOE_MAX_PFNS") == ("MOE_MAX_PFNS", "")
    assert lru.knob_named("NO_SUCH") == ("NO_SUCH", "")
    new, notice = lru.knob_named("MAX_PFNS")
    assert new == "MOE_MAX_PFNS"
    assert "\n" not in notice and "lru.MAX_PFNS" in notice and "lru.MOE_MAX_PFNS" in notice and "deprecated" in notice


def _lru_recorder(knobs):
    said: list[str] = []
    ctx = RecordContext(features=None, plan=AttachPlan("lru", []), knobs=knobs, say=said.append)
    return recorder_class("lru")(ctx), said


def test_record_knob_accepts_the_old_name_with_one_deprecation_line():
    rec, said = _lru_recorder({"MAX_PFNS": 4096, "MOE_MAX_INODES": 99})
    out = rec.with_user_knobs({"MOE_MAX_PFNS": 65536, "MOE_MAX_INODES": 16})
    assert out == {"MOE_MAX_PFNS": 4096, "MOE_MAX_INODES": 99}
    assert len(said) == 1 and "lru.MOE_MAX_PFNS" in said[0]


def test_record_knob_new_names_say_nothing_and_unknown_names_still_fail():
    rec, said = _lru_recorder({"MOE_MAX_PFNS": 4096})
    assert rec.with_user_knobs({})["MOE_MAX_PFNS"] == 4096 and said == []
    rec, _ = _lru_recorder({"MAX_BOGUS": 1})
    with pytest.raises(UsageError, match="has no knob MAX_BOGUS"):
        rec.with_user_knobs({})


def test_record_cli_passes_an_old_knob_name_to_the_recorder(monkeypatch):
    """`record --knob lru.PPE=V` reaches the recorder as given (the recorder maps and says it)."""
    from click.testing import CliRunner

    import moetrace.kernel.features as features
    import moetrace.record.recorder as recorder
    from moetrace.cli import cli

    seen = {}

    def fake_record(opts, on_event):
        seen["knobs"] = opts.knobs
        raise UsageError("stop here")

    monkeypatch.setattr(features, "private_mounts", lambda: None)
    monkeypatch.setattr(recorder, "record", fake_record)
    res = CliRunner().invoke(cli, ["record", "--probes", "lru", "--knob", "lru.MAX_PFNS=4096", "--", "true"])
    assert seen["knobs"] == {"lru": {"MAX_PFNS": 4096}}, res.output


# -- compile vocabulary -----------------------------------------------------------------------

def test_an_old_run_reads_under_the_new_key_names():
    from moetrace.run.directory import read_manifest

    raw = (DATA / "run" / "manifest.json").read_text()
    assert "compile_attach_s" in raw and "compiled_out" in raw  # the golden run is an old one
    doc = read_manifest(DATA / "run")
    t = doc["timings"]
    assert t["pagecache_load_attach_s"] == 1.0903 and not [k for k in t if "compile" in k]
    assert doc["attach_plan"]["pagecache"]["switched_off"] and "compiled_out" not in doc["attach_plan"]["pagecache"]
    assert doc["summaries"]["block"]["load_s"] > 0 and "compile_s" not in doc["summaries"]["block"]
    assert doc["summaries"]["reclaim"]["load_s"] > 0
    assert doc["summaries"]["reads"]["load_attach_s"] > 0


def test_upgrade_keeps_a_new_key_over_an_old_one():
    from moetrace.run.directory import upgrade_renamed_keys

    doc = {"timings": {"lru_compile_attach_s": 1.0, "lru_load_attach_s": 2.0, "probes_attach_s": 3.0},
           "attach_plan": {"x": {"compiled_out": {"a": "b"}}, "y": None}, "summaries": {"block": {"compile_s": 4}}}
    assert upgrade_renamed_keys(doc) == {"timings": {"lru_load_attach_s": 2.0, "probes_attach_s": 3.0},
                                         "attach_plan": {"x": {"switched_off": {"a": "b"}}, "y": None},
                                         "summaries": {"block": {"load_s": 4}}}


#: product files: what a user installs or reads
PRODUCT = ("toolkit", "analyses", "probes", "README.md", "docs")
#: phrases of compile-per-run: a probe compiled (or a program compiled in / out) at record time
COMPILE_AT_RECORD = re.compile(
    r"1: compile\b|-D knob|\bcompile_s\b|compile_attach|\bcompiled_out\b|(is|are|: |\") ?compiled out"
    r"|compiled out \(|compiles? (it )?out\b|compiled in only"
    r"|compile (the |a )?(probe|program|kprobe|tracepoint|sys_)|probes? (are |is )?compiled (and|at|when|per)"
    r"|\bcompile(d)? with (MOE_|the (attach )?plan)|when the probe compiles|probe was compiled"
    r"|NA when not compiled|failed to compile|first probes compile",
    re.IGNORECASE)
#: where compiling is right: the set-up's build; and the two places that name older runs' keys
#: so that they are still read (run/directory.py RENAMED_KEYS, run/documents.py RETIRED)
ALLOWED = {"scripts/build-probes.sh", "toolkit/run/directory.py", "toolkit/run/documents.py"}


def _product_files():
    for top in PRODUCT:
        p = ROOT / top
        files = [p] if p.is_file() else sorted(p.rglob("*"))
        for f in files:
            if f.suffix in (".py", ".md", ".c", ".h", ".toml", ".sh") and "__pycache__" not in f.parts \
                    and "build" not in f.relative_to(ROOT).parts:
                yield f


def test_no_product_file_speaks_of_compiling_a_probe_at_record_time():
    hits = []
    for f in _product_files():
        rel = str(f.relative_to(ROOT))
        if rel in ALLOWED:
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if COMPILE_AT_RECORD.search(line):
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert not hits, "compile-per-run vocabulary (nothing is compiled at record time):\n" + "\n".join(hits)


def test_the_vocabulary_check_catches_the_old_phrases():
    for old in ('Knob("MOE_HAVE_DIRECT", 1, "1: compile direct_reclaim_begin/end")', "pass -D knob=V",
                'timings["x_compile_attach_s"]', '"compile_s": 0.3', "unavailable: compiled out (K=0)",
                "this kernel compiles it out", "Probes are compiled and attached first",
                "or failed to compile, load, attach", "(mm_lru_activate; NA when not compiled)"):
        assert COMPILE_AT_RECORD.search(old), old
    for fine in ("compiled once by the set-up", "plan compile", "a compiler clone", "compile_plan(",
                 "the compiled probes relocate against it"):
        assert not COMPILE_AT_RECORD.search(fine), fine
