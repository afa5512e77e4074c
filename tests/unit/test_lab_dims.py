"""Issue 34's matrix dimensions, the eviction controller and the guest wrapper, without a guest
(no-kernel tier): every spec key and its errors, the cells and their names, a spec without the
keys exactly as before, the watermark model against recorded /proc/zoneinfo, the controller's
commands against recorded lru_gen text, and the wrapper's settings on a fake /proc and /sys."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from moetrace.errors import InputError, UsageError
from moetrace.lab import matrix as M

DATA = Path(__file__).resolve().parents[1] / "data"
MIB = 1 << 20
#: written before the dimensions existed; its digest and cells as moetrace computed them then
#: (main at 713356e: digest bd5d30194e5b08be, the cells' as_dict sha256 86a6295406e89538)
OLD_SPEC = '''kernels = ["6.1", "6.12"]
mglru = ["on", "off"]
mechanisms = ["cgroup", "balloon:0.81", "vm-memory"]
capacities = ["192MiB", "320MiB"]
repeats = 2
plan = "/var/tmp/plan.bin"
pool = "/var/tmp/pool"
mode = "mmap"
threads = 4
passes = 3
'''
BASE = '''kernels = ["6.12"]
mglru = ["on"]
mechanisms = ["balloon:0.81"]
capacities = ["320MiB"]
repeats = 1
plan = "/var/tmp/plan.bin"
pool = "/var/tmp/pool"
'''


def load(tmp_path: Path, text: str):
    p = tmp_path / "spec.toml"
    p.write_text(text)
    return M.load_spec(p)


def cells_digest(spec) -> str:
    return hashlib.sha256(json.dumps([c.as_dict() for c in spec.cells()]).encode()).hexdigest()[:16]


@pytest.mark.parametrize("edit", [lambda s: s, lambda s: s.replace("threads = 4", "readers = 4"),
                                  lambda s: s.replace("passes = 3", "window = 3"),
                                  lambda s: s.replace("threads = 4", "readers = [4]").replace("passes = 3", "window = [3]")])
def test_a_spec_without_the_new_keys_is_the_matrix_it_was(tmp_path, edit):
    """Same digest, same cells in the same order, same directories and commands as before issue 34
    (readers / window with one value are threads / passes: the same spec)."""
    spec = load(tmp_path, edit(OLD_SPEC))
    assert spec.digest() == "bd5d30194e5b08be" and cells_digest(spec) == "86a6295406e89538"
    assert spec.dims == () and all(c.dims == "" and c.values == () for c in spec.cells())
    assert spec.cells()[0].rel_dir == "cells/6.1-mglru-on/cgroup-320MiB-r0"
    cmd = M.cell_command(spec.cells()[3], spec)
    assert cmd[cmd.index("--threads") + 1] == "4" and cmd[cmd.index("--passes") + 1] == "3"
    assert "--duration" not in cmd and "--balloon-thp" not in cmd


@pytest.mark.parametrize("line, needle", [
    ("cpus = 0", "cpus: 0 is not an integer in \\[1, 64\\]"),
    ("cpus = [1, 1]", "cpus names one value twice"),
    ("cpus = []", "cpus must be a value or a non-empty list"),
    ("readers = 2.5", "readers: 2.5 is not an integer"),
    ("min_free_kbytes = 12", "min_free_kbytes: 12 is not an integer in \\[128"),
    ("bite_fraction = 1.2", "bite_fraction: 1.2 is not a fraction"),
    ("bite_fraction = true", "bite_fraction: True is not a fraction"),
    ("window = 0", "window: 0 is not an integer"),
    ('window = "8 fortnights"', "window: cannot read a duration"),
    ('window = "70min"', "window 4200s leaves less than 300 s of timeout"),
    ('pool_layout = "stripe"', "pool_layout: 'stripe' is not one of expert, layer"),
    ("read_ahead_kb = -1", "read_ahead_kb: -1 is not an integer"),
    ("min_ttl_ms = -5", "min_ttl_ms: -5 is not an integer"),
    ('swap = "1KiB"', "swap: '1KiB' is neither \"off\" nor a swap size"),
    ('thp = "maybe"', "thp: 'maybe' is not one of on, off"),
    ('tcg_thread = "many"', "tcg_thread 'many' is not one of single, multi"),
    ('stream_events = "yes"', "stream_events must be true or false, not 'yes'"),
    ("threads = 2\nreaders = 4", "threads and readers are the same key"),
    ("passes = 2\nwindow = 3", "passes and window both set the measured window"),
    ("bite_fraction = 0.1\nmin_free_kbytes = 4096", "bite_fraction and min_free_kbytes both"),
    ("threads = [0, 2]", "readers: 0 is not an integer"),
])
def test_a_bad_dimension_is_an_input_error_naming_the_key_and_the_spec(tmp_path, line, needle):
    with pytest.raises(InputError, match=needle) as ei:
        load(tmp_path, BASE + line + "\n")
    assert str(tmp_path / "spec.toml") in ei.value.format_message()


@pytest.mark.parametrize("mech, needle", [
    ('"cgroup+lru_gen-bites:0.26"', "a cgroup\\s+wall does not lower"),
    ('"balloon:0.81+lru_gen-bites:1.5"', "not a bites controller suffix"),
    ('"balloon:0.81+lru_gen-bites:lots"', "not a bites controller suffix"),
    ('"balloon:0.81+kswapd:0.26"', "not a bites controller suffix"),
])
def test_a_bad_bites_mechanism_is_an_error(tmp_path, mech, needle):
    with pytest.raises((InputError, UsageError), match=needle) as ei:
        load(tmp_path, BASE.replace('["balloon:0.81"]', f"[{mech}]"))
    assert "spec.toml" in ei.value.format_message()


def test_dimensions_cross_the_cells_and_name_only_what_varies(tmp_path):
    spec = load(tmp_path, BASE + 'cpus = [1, 2]\nbite_fraction = [0.02, 0.26]\nswap = "64MiB"\nthp = "off"\n'
                                 'window = ["8min", 2]\nreaders = [1, 2]\n')
    cells = spec.cells()
    assert len(cells) == 2 * 2 * 2 * 2
    names = sorted(c.name for c in cells)
    assert len(set(c.rel_dir for c in cells)) == len(cells)
    assert "balloon0.81-320MiB-cpus1-readers1-bite0.02-8min-r0" in names
    assert "balloon0.81-320MiB-cpus2-readers2-bite0.26-2passes-r0" in names
    assert not any("swap" in n or "thp" in n for n in names)  # one value: in every cell, not in names
    c = next(c for c in cells if c.name == "balloon0.81-320MiB-cpus2-readers2-bite0.26-2passes-r0")
    assert c.settings == {"cpus": 2, "readers": 2, "bite_fraction": 0.26, "window": 2, "swap": 64 * MIB, "thp": "off"}
    assert c.as_dict()["dims"] == "cpus2-readers2-bite0.26-2passes" and c.as_dict()["settings"]["swap"] == 64 * MIB
    assert spec.canonical()["window"] == ["480s", 2] and spec.canonical()["swap"] == [64 * MIB]
    assert M.spec_from_canonical(spec.canonical()) == spec and cells == spec.cells()
    assert sorted(c.order for c in cells) == list(range(16))


def test_a_cells_command_and_its_guest_settings_follow_its_dimensions(tmp_path):
    spec = load(tmp_path, BASE.replace('["balloon:0.81"]', '["balloon:0.81+lru_gen-bites:0.25", '
                                                           '"vm-memory+lru_gen-bites:5MiB"]')
                + 'window = "8min"\nreaders = 3\nthp = "on"\nread_ahead_kb = 1024\nbite_fraction = 0.26\n'
                  'min_ttl_ms = 1000\nswap = "off"\ncpus = 2\ntcg_thread = "multi"\nstream_events = true\n')
    by = {c.mechanism.kind: c for c in spec.cells()}
    cmd = M.guest_command(by["balloon"], spec, "/m/curve.npz")
    assert cmd[:6] == ["moetrace", "lab", "guest-cell", "--dir", "/tmp/lab", "--settings"] and cmd[7] == "--"
    cell = cmd[8:]
    assert cell == M.cell_command(by["balloon"], spec, "/m/curve.npz")
    for opt, want in (("--threads", "3"), ("--passes", "1"), ("--duration", "480s"), ("--balloon-thp", "on"),
                      ("--probes", "+vmscan"), ("--mechanism", "balloon")):
        assert cell[cell.index(opt) + 1] == want, opt
    settings = json.loads(cmd[6])
    assert settings == {"capacity_bytes": 320 * MIB, "pool": "/var/tmp/pool", "memcg": "/moetrace-cell",
                        "min_free_kbytes": None, "bite_fraction": 0.26, "read_ahead_kb": 1024, "min_ttl_ms": 1000,
                        "swap": False, "thp": "on", "bites_bytes": 80 * MIB, "sampler": True}
    assert json.loads(M.guest_command(by["vm-memory"], spec)[6])["bites_bytes"] == 5 * MIB
    assert "--balloon-thp" not in M.cell_command(by["vm-memory"], spec)  # no balloon to madvise
    assert "--stream-events" in cell and spec.canonical()["stream_events"] is True
    assert M.spec_from_canonical(spec.canonical()) == spec
    plain = load(tmp_path, BASE)  # absent: no streams, and the spec (its digest) as before the key
    assert "--stream-events" not in M.cell_command(plain.cells()[0], plain) and "stream_events" not in plain.canonical()
    assert by["balloon"].mechanism.label == "balloon0.81+bites0.25"
    assert M.parse_mechanism("vm-memory+bites5MiB", "x") == by["vm-memory"].mechanism  # the label reads back
    assert M._boot_options(by["balloon"], spec) == {"cpus": 2, "tcg_thread": "multi"}
    from moetrace.lab.guest import parse_request

    assert parse_request(cmd[6]) == settings


class Guest:
    """run_in_guest's stand-in: records its keywords; writes a guest_settings.json as asked."""

    def __init__(self, settings_errors=()):
        self.calls, self.errors = [], list(settings_errors)

    def __call__(self, kernel, command, out, **kw):
        from moetrace.lab.run import LabResult

        self.calls.append((Path(out).name, command, kw))
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "guest_settings.json").write_text(json.dumps(
            {"schema": "moetrace.guest/1", "request": json.loads(command[6]), "errors": self.errors}))
        return LabResult("ok", 4 if self.errors else 0, {"status": "ok", "exit_status": 4 if self.errors else 0,
                                                          "mglru": "0x0007", "mglru_requested": kw["mglru"]})


def test_run_one_boots_with_the_cells_vcpus_and_swap_and_keeps_what_the_guest_got(tmp_path):
    from tests.unit.test_lab_matrix import make_plan

    make_plan(tmp_path / "plan.bin")
    spec = load(tmp_path, BASE.replace("/var/tmp/plan.bin", str(tmp_path / "plan.bin"))
                .replace('mglru = ["on"]', 'mglru = ["on", "off"]')
                .replace('["balloon:0.81"]', '["balloon:0.81+lru_gen-bites:0.26"]') + 'cpus = 2\nswap = "64MiB"\n')
    out = tmp_path / "m"
    work = M.prepare(out, spec, resume=False)
    guest = Guest(["thp: cannot write"])
    M.run_cells(out, spec, work, run_guest=guest)
    assert len(guest.calls) == 1  # MGLRU off: the controller cannot run, no boot
    assert guest.calls[0][2]["cpus"] == 2 and guest.calls[0][2]["swap_bytes"] == 64 * MIB
    docs = {d["cell"]["mglru"]: d for d in M.finished(out)}
    assert not docs["off"]["retained"] and "needs MGLRU on" in docs["off"]["reasons"][0]
    assert not docs["on"]["retained"] and "guest: thp: cannot write" in docs["on"]["reasons"]
    assert docs["on"]["guest"]["request"]["bites_bytes"] == int(0.26 * 320 * MIB)
    from moetrace.run.documents import MatrixRow, undeclared

    assert not [p for d in docs.values() for p in undeclared(d, MatrixRow)]


def test_rows_carry_the_dimensions_and_what_the_guest_got_and_the_summary_groups_by_them(tmp_path):
    from tests.unit.test_lab_matrix import FakeGuest, make_plan

    from moetrace.reports.matrix import summarize

    class WithGuest(FakeGuest):
        def __call__(self, kernel, command, out, **kw):
            res = super().__call__(kernel, command, out, **kw)
            req = json.loads(command[6])
            Path(out, "guest_settings.json").write_text(json.dumps(
                {"schema": "moetrace.guest/1", "request": req, "errors": [],
                 "watermarks": {"after": {"sum_high_pages": 21299, "bite_fraction": req["bite_fraction"],
                                          "min_free_kbytes": 56808, "watermark_scale_factor": 10}},
                 "knobs": {"thp": {"after": "never"}}}))
            return res

    make_plan(tmp_path / "plan.bin")
    spec = load(tmp_path, BASE.replace("/var/tmp/plan.bin", str(tmp_path / "plan.bin")).replace("repeats = 1",
                                                                                              "repeats = 2")
                + 'bite_fraction = [0.02, 0.26]\nthp = "off"\n')
    out = tmp_path / "m"
    M.run_cells(out, spec, M.prepare(out, spec, resume=False), run_guest=WithGuest())
    rows = M.matrix_rows(out)
    assert len(rows) == 4 and {r["dims"] for r in rows} == {"bite0.02", "bite0.26"}
    r = next(r for r in rows if r["dims"] == "bite0.26")
    assert (r["bite_fraction"], r["thp"], r["guest_bite_fraction"], r["guest_thp"]) == (0.26, "off", 0.26, "never")
    assert r["guest_sum_high_pages"] == 21299 and "controller_bites" not in r
    summary = summarize(rows)
    assert sorted((s["dims"], s["cells"]) for s in summary) == [("bite0.02", 2), ("bite0.26", 2)]
    assert "balloon0.81 bite0.26" in M.write_table(out).with_name("matrix_summary.md").read_text()


def test_a_layer_layout_cell_reads_a_per_layer_copy_of_the_pool_made_once(tmp_path):
    from tests.unit.test_lab_matrix import FakeGuest, make_plan

    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.pool import create_pool, open_pool

    make_plan(tmp_path / "plan.bin")
    create_pool(tmp_path / "pool", Geometry(1, 8, 8, 1 << 20, "t"), layout="files")
    spec = load(tmp_path, BASE.replace("/var/tmp/plan.bin", str(tmp_path / "plan.bin"))
                .replace("/var/tmp/pool", str(tmp_path / "pool")) + 'pool_layout = ["expert", "layer"]\n')
    out = tmp_path / "m"
    guest = FakeGuest()
    M.run_cells(out, spec, M.prepare(out, spec, resume=False), run_guest=guest)
    by = {name.split("-")[2]: (cmd, mem) for _k, _g, name, mem, _env, cmd in guest.calls}
    layer_cmd = by["layerfiles"][0]
    assert layer_cmd[layer_cmd.index("--pool") + 1] == str(out.resolve() / "pools" / "layer")
    assert json.loads(layer_cmd[6])["pool"] == str(out.resolve() / "pools" / "layer")
    assert by["expertfiles"][0][by["expertfiles"][0].index("--pool") + 1] == str(tmp_path / "pool")
    assert open_pool(out / "pools" / "layer").layout == "layers"


# -- the watermarks -----------------------------------------------------------------------------

def zones(name: str):
    from moetrace.kernel.procfs import parse_zoneinfo

    return parse_zoneinfo((DATA / "guest" / name).read_text())


@pytest.mark.parametrize("name, min_free, wsf", [("zoneinfo_6.12_512M.txt", 2731, 10),
                                                 ("zoneinfo_6.18_24G.txt", 67584, 10)])
def test_the_watermark_model_is_the_kernels(name, min_free, wsf):
    """mm/page_alloc.c's __setup_per_zone_wmarks, zone by zone, against recorded /proc/zoneinfo
    (whose watermarks count the zone's boost in)."""
    from moetrace.lab.watermarks import sum_high, zone_marks

    zs = zones(name)
    for z, m in zip(zs, zone_marks(zs, min_free, wsf)):
        if z["managed"]:
            assert (m["min"], m["low"], m["high"]) == (z["min"] - z["boost"], z["low"] - z["boost"],
                                                        z["high"] - z["boost"]), z["zone"]
    assert sum_high(zs, min_free, wsf) == sum(z["high"] - z["boost"] for z in zs if z["managed"])


def test_a_bite_fraction_becomes_min_free_kbytes_then_the_scale_factor():
    """Σhigh / C = 0.26 at C = 320 MiB in the recorded 512 MiB 6.12 guest: min_free_kbytes alone
    (a quarter of the managed memory at most); a target below what 1 MiB of min_free_kbytes
    gives at factor 10 brings the factor down first."""
    from moetrace.lab.watermarks import MIN_FREE_FLOOR_KB, plan_watermarks, sum_high

    zs = zones("zoneinfo_6.12_512M.txt")
    target = int(0.26 * 320 * MIB / 4096)
    p = plan_watermarks(zs, target, 10)
    assert p.watermark_scale_factor == 10 and p.reachable and abs(p.predicted_sum_high_pages - target) <= 2
    assert p.min_free_kbytes == pytest.approx(target * 4 / 1.5, rel=0.02)  # min/4 > the factor's gap: 1.5 x min
    small = plan_watermarks(zs, 400, 10)  # 1 MiB of min_free_kbytes gives ~490 pages at factor 10
    assert small.min_free_kbytes >= MIN_FREE_FLOOR_KB and small.watermark_scale_factor < 10 and small.reachable
    assert sum_high(zs, small.min_free_kbytes, small.watermark_scale_factor) == small.predicted_sum_high_pages
    low = plan_watermarks(zs, 10, 10)  # below what the floor gives at factor 1: as close as it gets
    assert not low.reachable and (low.min_free_kbytes, low.watermark_scale_factor) == (MIN_FREE_FLOOR_KB, 1)


def fake_guest(tmp_path: Path, zoneinfo: str = "zoneinfo_6.12_512M.txt") -> Path:
    """A /proc and /sys tree of a guest: the knobs the wrapper writes, as files."""
    root = tmp_path / "root"
    files = {"proc/sys/vm/min_free_kbytes": "2731", "proc/sys/vm/watermark_scale_factor": "10",
             "proc/zoneinfo": (DATA / "guest" / zoneinfo).read_text(), "proc/swaps": "Filename\tType\n",
             "sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never",
             "sys/kernel/mm/lru_gen/min_ttl_ms": "0", "sys/kernel/mm/lru_gen/enabled": "0x0007",
             "sys/block/vda/serial": "", "sys/block/vdb/serial": "moetrace-swap"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return root


def simulated_kernel(root: Path, zs0):
    """/proc/zoneinfo's zones as the kernel would set them for the knobs written in ``root``."""
    from moetrace.lab.watermarks import zone_marks

    def read():
        mf = int((root / "proc/sys/vm/min_free_kbytes").read_text())
        w = int((root / "proc/sys/vm/watermark_scale_factor").read_text())
        return [{**z, **m, "boost": 0} for z, m in zip(zs0, zone_marks(zs0, mf, w))]
    return read


def test_the_wrapper_reaches_a_bite_fraction_records_it_and_puts_every_knob_back(tmp_path):
    from contextlib import ExitStack

    from moetrace.lab import guest as G

    root = fake_guest(tmp_path)
    req = G.parse_request(json.dumps({"capacity_bytes": 320 * MIB, "bite_fraction": 0.26, "thp": "off",
                                      "min_ttl_ms": 1000}))
    doc = {"knobs": {}, "restored": [], "notes": [], "errors": []}
    with ExitStack() as stack:
        G._thp(req, doc, stack, root)
        G._min_ttl(req, doc, stack, root)
        G._watermarks(req, doc, stack, root, read_zones=simulated_kernel(root, zones("zoneinfo_6.12_512M.txt")))
        assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_text() == "never\n"
        assert (root / "sys/kernel/mm/lru_gen/min_ttl_ms").read_text() == "1000\n"
    w = doc["watermarks"]
    assert w["before"]["sum_high_pages"] == 1019 and w["before"]["min_free_kbytes"] == 2731
    assert w["reached"] and len(w["attempts"]) == 1 and w["after"]["bite_fraction"] == pytest.approx(0.26, abs=1e-3)
    assert doc["knobs"]["thp"]["before"] == "madvise" and doc["knobs"]["thp"]["after"] == "never"
    assert doc["knobs"]["min_free_kbytes"]["after"] == w["attempts"][0]["min_free_kbytes"] > 2731
    assert sorted(doc["restored"]) == ["min_free_kbytes", "min_ttl_ms", "thp", "watermark_scale_factor"]
    assert (root / "proc/sys/vm/min_free_kbytes").read_text() == "2731\n"
    assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_text() == "madvise\n"


def test_the_wrapper_finds_the_swap_disk_and_the_pools_queue(tmp_path):
    import os

    from moetrace.lab import guest as G

    root = fake_guest(tmp_path)
    assert G.swap_device(root) == "/dev/vdb"
    pool = tmp_path / "pool"
    pool.mkdir()
    st = os.stat(pool)
    q = root / "sys/dev/block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}" / "queue"
    q.mkdir(parents=True)
    assert G.queue_dir(pool, root) == q.resolve()
    ran = []

    def run(argv, **kw):
        import subprocess

        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    from contextlib import ExitStack

    doc = {"knobs": {}, "restored": [], "notes": [], "errors": []}
    with ExitStack() as stack:
        G._swap({"swap": True}, doc, stack, root, run=run)
        assert ran == [["mkswap", "-f", "/dev/vdb"], ["swapon", "/dev/vdb"]] and doc["swap"]["on"]
    assert ran[-1] == ["swapoff", "/dev/vdb"] and doc["swap"]["off_at_end"] is True
    (root / "sys/block/vdb/serial").write_text("other\n")
    with pytest.raises(UsageError, match="no swap disk"), ExitStack() as stack:
        G._swap({"swap": True}, doc, stack, root, run=run)


@pytest.mark.parametrize("text, needle", [
    ("[]", "must be a JSON object"), ("{", "not JSON"), ('{"swap": "yes"}', "swap must be bool"),
    ('{"thp": "always"}', "thp 'always'"), ('{"bites_bytes": 4096}', "need capacity_bytes"),
    ('{"cpus": 2}', "unknown key"),
])
def test_bad_guest_settings_are_usage_errors(text, needle):
    from moetrace.lab.guest import parse_request

    with pytest.raises(UsageError, match=needle):
        parse_request(text)


def test_the_wrapper_runs_the_cell_and_records_a_setting_it_could_not_apply(tmp_path):
    from moetrace.lab import guest as G
    from moetrace.run.metadata import read_guest_settings

    root = fake_guest(tmp_path)
    lab = tmp_path / "lab"
    lab.mkdir()
    req = G.parse_request(json.dumps({"capacity_bytes": 320 * MIB, "min_ttl_ms": 5, "sampler": False}))
    assert G.run_guest_cell(req, ["sh", "-c", "exit 7"], lab, root) == 7
    doc = read_guest_settings(lab)
    assert doc["exit_status"] == 7 and doc["errors"] == [] and doc["restored"] == ["min_ttl_ms"]
    (root / "sys/kernel/mm/lru_gen/min_ttl_ms").unlink()  # a kernel without MGLRU
    assert G.run_guest_cell(req, ["sh", "-c", "exit 0"], lab, root) == G.EXIT_SETUP
    doc = read_guest_settings(lab)
    assert doc["exit_status"] is None and "min_ttl_ms" in doc["errors"][0]
    req = G.parse_request(json.dumps({"capacity_bytes": 320 * MIB, "bites_bytes": 5 * MIB}))
    (root / "sys/kernel/mm/lru_gen/enabled").write_text("0x0000\n")
    assert G.run_guest_cell(req, ["true"], lab, root) == G.EXIT_SETUP
    assert "MGLRU is off" in read_guest_settings(lab)["errors"][0]


# -- the eviction controller ----------------------------------------------------------------------

def test_the_controller_bites_below_its_threshold_from_the_oldest_file_generation():
    """The recorded 6.12 lru_gen (generations 5..8, file pages from 6): evict through 6 (max_seq -
    2) at once; MemFree at or above the threshold: nothing."""
    from moetrace.lab.bites_controller import bite_commands, lruvecs

    text = (DATA / "lru_gen" / "6.12_lru_gen.txt").read_text()
    (v,) = lruvecs(text)
    assert (v.memcg_id, v.memcg_path, v.min_seq, v.max_seq, v.oldest_file_pages) == (2, "/moe", 6, 8, 42038)
    assert bite_commands(text, 9000, 10000, 21299) == ["- 2 0 6 0 21299"]
    assert bite_commands(text, 10000, 10000, 21299) == []
    full = (DATA / "lru_gen" / "6.12_lru_gen_full.txt").read_text()  # 'x' marks: min_seq[file] = 6 exactly
    assert bite_commands(full, 1, 2, 100, memcg_path="/moe") == ["- 2 0 6 0 100"]
    # generation 6 emptied of file pages but kept (not 'x'): min_seq[file] is still 6 in the full
    # format; the short format can only take the first generation with file pages, 7
    emptied = full.replace("          6        676          2       42038 ", "          6        676          2           0 ")
    (v,) = [x for x in lruvecs(emptied) if x.node == 0]
    assert (v.min_seq, v.oldest_file_pages) == (6, 0)
    (v,) = lruvecs(text.replace("42038", "    0"))
    assert v.min_seq == 7


def test_the_controller_ages_when_only_two_file_generations_remain():
    from moetrace.lab.bites_controller import bite_commands, choose, lruvecs

    text = ("memcg     1 /\n node     0\n         20      30000        100         500\n"
            "         21      30000          0         800\n"
            "memcg     7 /moetrace-cell\n node     0\n         11       1500          0           0\n"
            "         12        900          3       30000\n         13        400          0       12000\n")
    assert bite_commands(text, 100, 200, 1280, memcg_path="/moetrace-cell") == ["+ 7 0 13 0 1", "- 7 0 12 0 1280"]
    assert choose(lruvecs(text), "/gone") is None  # the cell's memcg not there (yet): no bite
    assert choose(lruvecs(text), None).memcg_id == 7  # no memcg named: the one with the most file pages
    assert choose(lruvecs(text), "/").memcg_id == 1
    assert bite_commands(text, 100, 200, 64, memcg_path="/") == ["+ 1 0 21 0 1", "- 1 0 20 0 64"]


def test_the_controllers_threshold_is_one_watermark_gap_above_high_with_the_lower_zones_reserve():
    """512 MiB 6.12 guest: DMA32 (high 987, low 823) the top zone, DMA below it (high 32, its
    lowmem_reserve for DMA32 440); the 24 GiB host: Normal on top, DMA and DMA32 below it (the
    host's zoneinfo shows boosted watermarks: the threshold is read with the boost)."""
    from moetrace.lab.bites_controller import default_threshold_kb

    assert default_threshold_kb(zones("zoneinfo_6.12_512M.txt")) == (2 * 987 - 823 + 32 + 440) * 4
    # the host's DMA zone (3840 pages) is smaller than its reserve for Normal (16 + 24090): all of it stays free
    assert default_threshold_kb(zones("zoneinfo_6.18_24G.txt")) == (2 * 35285 - 29891 + 3840 + 3660 + 21071) * 4


def test_the_controller_thread_bites_logs_each_bite_and_stops(tmp_path):
    """The loop on a fake /proc and debugfs: MemFree below the threshold -> a bite (its command
    written to lru_gen, the state read from lru_gen_full), one row in bites.csv, no memory kept."""
    import csv
    import time

    from moetrace.lab.bites_controller import CSV_COLUMNS, BitesController

    root = fake_guest(tmp_path)
    dbg = root / "sys/kernel/debug"
    dbg.mkdir(parents=True)
    (root / "proc/mounts").write_text("none /sys/kernel/debug debugfs rw,relatime 0 0\n")
    (dbg / "lru_gen").write_text("")
    (dbg / "lru_gen_full").write_text((DATA / "lru_gen" / "6.12_lru_gen_full.txt").read_text())
    (root / "proc/meminfo").write_text("MemTotal:        3000000 kB\nMemFree:            4000 kB\n")
    (root / "proc/vmstat").write_text("pgsteal_kswapd 5\npgsteal_direct 17\n")
    with BitesController(tmp_path / "lab", 3072, memcg_path="/moe", root=root, interval_s=0.01) as c:
        assert c.threshold_kb == (2 * 987 - 823 + 32 + 440) * 4  # from the fake /proc/zoneinfo
        deadline = time.monotonic() + 10
        while c.stats["bites"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    s = c.summary()
    assert s["bites"] >= 1 and s["error"] is None and s["polls"] >= 1
    assert (dbg / "lru_gen").read_text() == "- 2 0 6 0 3072\n"
    with open(tmp_path / "lab" / "bites.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert rows[0]["memcg_path"] == "/moe" and rows[0]["min_seq_before"] == "6" and rows[0]["evictions"] == "1"
    assert rows[0]["steal_pages"] == "0" and rows[0]["error"] == "" and rows[0]["memfree_before_kb"] == "4000"
    # the cell's memcg gone (the cell removed its scope): no bite, no row, counted as skipped
    with BitesController(tmp_path / "lab2", 3072, memcg_path="/gone", root=root, interval_s=0.01) as c2:
        deadline = time.monotonic() + 10
        while c2.stats["skipped"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert c2.summary()["bites"] == 0 and c2.summary()["skipped"] >= 1
    assert (tmp_path / "lab2" / "bites.csv").read_text().count("\n") == 1  # the header alone
