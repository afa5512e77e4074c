"""Flame graphs: folded parsing and its errors, the call tree, the SVG (structure, widths,
determinism, inlining), speedscope, the differential graph, and (when a Chromium is
installed) the embedded script driven headless, standalone and inlined in HTML."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.errors import InputError
from moetrace.reports import flame as F

NS = "{http://www.w3.org/2000/svg}"

FOLDED = """\
python;libc.so.6`preadv2;entry_SYSCALL_64_after_hwframe_[k];do_syscall_64_[k];do_preadv_[k] 12
python;libc.so.6`preadv2;entry_SYSCALL_64_after_hwframe_[k];do_syscall_64_[k];__x64_sys_futex_[k] 4
python;libpython3.12.so.1.0`_PyEval_EvalFrameDefault 6

python;libc.so.6`preadv2 2
kswapd0;kthread_[k];kswapd_[k];shrink_node_[k] 5
python;libpython3.12.so.1.0`_PyEval_EvalFrameDefault 1
"""
TOTAL = 30

# b: futex doubled, kswapd gone, a new stack
FOLDED_B = """\
python;libc.so.6`preadv2;entry_SYSCALL_64_after_hwframe_[k];do_syscall_64_[k];do_preadv_[k] 12
python;libc.so.6`preadv2;entry_SYSCALL_64_after_hwframe_[k];do_syscall_64_[k];__x64_sys_futex_[k] 8
python;libpython3.12.so.1.0`_PyEval_EvalFrameDefault 7
python;libc.so.6`preadv2 2
python;libc.so.6`malloc 3
"""


def frames_of(svg: str) -> list[ET.Element]:
    """The frame <g> elements of an SVG document, in document order."""
    return [g for g in ET.fromstring(svg).iter(f"{NS}g") if "data-name" in g.attrib]


def path_values(stacks: dict[str, int]) -> dict[str, int]:
    """Inclusive samples per ;-joined prefix, computed directly from the stacks."""
    out: dict[str, int] = {}
    for s, n in stacks.items():
        parts = s.split(";")
        for i in range(1, len(parts) + 1):
            p = ";".join(parts[:i])
            out[p] = out.get(p, 0) + n
    return out


# ---------------------------------------------------------------------------
# input


def test_parse_sums_duplicates_and_skips_blank_lines():
    st_ = F.parse_folded(FOLDED)
    assert st_["python;libpython3.12.so.1.0`_PyEval_EvalFrameDefault"] == 7
    assert len(st_) == 5 and sum(st_.values()) == TOTAL
    # CRLF, surrounding blanks, a frame name with a space, a zero count
    assert F.parse_folded("\r\n a;b c 3\r\na;b c 2\n\nx 0\n") == {"a;b c": 5, "x": 0}
    assert F.parse_folded("") == {} and F.parse_folded("\n  \n") == {}


@pytest.mark.parametrize("line, what", [
    ("a;b;c", "no sample count"),
    ("a;b 1.5", "not a non-negative integer"),
    ("a;b -3", "not a non-negative integer"),
    ("a;b 0x10", "not a non-negative integer"),
    ("a;;b 3", "empty frame"),
    (";a 3", "empty frame"),
])
def test_parse_errors_name_file_and_line(line, what):
    text = f"ok;stack 1\n\n{line}\nok 2\n"
    with pytest.raises(InputError) as ei:
        F.parse_folded(text, source="run/stacks.folded")
    e = ei.value
    assert (e.path, e.line) == ("run/stacks.folded", 3)
    assert what in e.message and e.message.startswith("run/stacks.folded: line 3: ")


def test_folded_from_table():
    df = pd.DataFrame({"stack": ["a;b", "a;c", "a;b"], "samples": pd.array([2, 3, 4], dtype="Int64"),
                       "comm": ["x", "y", "z"]})
    assert F.folded_from_table(df) == {"a;b": 6, "a;c": 3}
    assert F.folded_from_table(pd.DataFrame({"stack": [], "samples": []})) == {}
    with pytest.raises(InputError, match="missing samples"):
        F.folded_from_table(pd.DataFrame({"stack": ["a"]}))
    for bad in ([1.5], [-1], [float("nan")]):
        with pytest.raises(InputError, match="row 0: samples"):
            F.folded_from_table(pd.DataFrame({"stack": ["a"], "samples": bad}))
    with pytest.raises(InputError, match="row 1: bad stack"):
        F.folded_from_table(pd.DataFrame({"stack": ["a", "a;;b"], "samples": [1, 1]}))
    # every drawing function takes text, a mapping or a table alike
    text = "a;b 6\na;c 3\n"
    assert F.flame_svg(text) == F.flame_svg({"a;b": 6, "a;c": 3}) == F.flame_svg(df)


# ---------------------------------------------------------------------------
# tree


def check_tree(stacks: dict[str, int]) -> F.Node:
    tree = F.build_tree(stacks)
    assert tree.name == "all" and tree.value == sum(stacks.values())
    want = path_values({s: n for s, n in stacks.items() if n > 0})
    seen = {}
    for node, depth, path in tree.walk():
        assert node.value == node.self_value + sum(c.value for c in node.children)
        assert [c.name for c in node.children] == sorted(c.name for c in node.children)
        assert len({c.name for c in node.children}) == len(node.children)
        assert node.value > 0 or depth == 0
        assert depth == (0 if not path else path.count(";") + 1)
        if path:
            seen[path] = node.value
            assert node.self_value == stacks.get(path, 0)
    assert seen == want
    return tree


def test_tree_values():
    tree = check_tree(F.parse_folded(FOLDED))
    assert [c.name for c in tree.children] == ["kswapd0", "python"]
    py = tree.children[1]
    assert (py.value, py.self_value) == (25, 0)
    libc = py.children[0]
    assert (libc.name, libc.value, libc.self_value) == ("libc.so.6`preadv2", 18, 2)
    assert F.build_tree({"a": 0}).children == []  # no samples, no frame


# ---------------------------------------------------------------------------
# the SVG


def test_svg_one_frame_per_node_widths_and_layout():
    stacks = F.parse_folded(FOLDED)
    svg = F.flame_svg(stacks, min_width_px=0, width=1000, frame_height=20)
    root = ET.fromstring(svg)
    assert root.tag == f"{NS}svg" and root.get("data-mode") == "flame"
    gs = frames_of(svg)
    nodes = list(F.build_tree(stacks).walk())
    assert len(gs) == len(nodes)
    inner = 1000 - 2 * F.PAD
    want = {"all": TOTAL} | path_values(stacks)
    by_path, ys = {}, {}
    for g, (node, depth, path) in zip(gs, nodes):  # pre-order, same as the tree's walk
        assert g.get("data-name") == node.name and int(g.get("data-samples")) == node.value
        assert int(g.get("data-depth")) == depth
        rect, text, title = g.find(f"{NS}rect"), g.find(f"{NS}text"), g.find(f"{NS}title")
        w = float(rect.get("width"))
        assert w == pytest.approx(node.value / TOTAL * inner, abs=0.006)
        pct = 100 * node.value / TOTAL
        assert title.text == f"{node.name} ({node.value} samples, {pct:.2f}%)"
        # label: the name or a ..-truncation of it that fits the box
        label = text.text or ""
        assert len(label) * F.CHAR_EM * 12 <= w - 6 + 1e-9 or label == ""
        assert label == node.name or (label.endswith("..") and node.name.startswith(label[:-2]))
        by_path[path or "all"] = (float(rect.get("x")), w)
        ys.setdefault(depth, set()).add(float(rect.get("y")))
        assert want[path or "all"] == node.value
    # root at the bottom: one row per depth, deeper = higher up
    assert all(len(ys[d]) == 1 for d in ys)
    rows = [ys[d].pop() for d in sorted(ys)]
    assert rows == sorted(rows, reverse=True) and len(set(rows)) == len(rows)
    # children sit inside their parent, side by side in name order
    x0, w0 = by_path["python;libc.so.6`preadv2"]
    x1, w1 = by_path["python;libc.so.6`preadv2;entry_SYSCALL_64_after_hwframe_[k]"]
    assert x0 == pytest.approx(x1, abs=0.01) and w1 < w0
    assert by_path["kswapd0"][0] == pytest.approx(F.PAD) and by_path["python"][0] == pytest.approx(
        F.PAD + 5 / TOTAL * inner, abs=0.01)


def test_svg_min_width_prunes_narrow_frames():
    stacks = {"a;b": 1000, "a;c": 1, "a;c;d": 1, "e": 2}
    tree = F.build_tree(stacks)
    inner, total = 1200 - 2 * F.PAD, tree.value
    for min_px in (0, 0.5, 1.5, 3.0, 1e9):
        want = [p for n, _, p in tree.walk() if p == "" or n.value / total * inner >= min_px]
        names = [g.get("data-name") for g in frames_of(F.flame_svg(stacks, min_width_px=min_px))]
        assert len(names) == len(want), min_px
    assert [g.get("data-name") for g in frames_of(F.flame_svg(stacks, min_width_px=2.0))] == ["all", "a", "b", "c", "e"]


def test_svg_deterministic_ids_and_escaping():
    stacks = F.parse_folded(FOLDED + "x<y>&\"z;std::vector<int>::push_back 3\n")
    a, b = F.flame_svg(stacks), F.flame_svg(dict(reversed(list(stacks.items()))))
    assert a == b  # same input, byte-identical; key order does not matter
    root = ET.fromstring(a)
    iid = root.get("id")
    assert re.fullmatch(r"mtf-[0-9a-f]{12}", iid)
    ids = [e.get("id") for e in root.iter() if e.get("id")]
    assert ids[0] == iid and all(i.startswith(iid + "-") for i in ids[1:])
    assert {"reset", "search", "status", "matched", "frames"} <= {i[len(iid) + 1:] for i in ids[1:]}
    assert F.flame_svg(stacks, title="other") != a  # the default id follows the content
    assert ET.fromstring(F.flame_svg(stacks, title="other")).get("id") != iid
    names = {g.get("data-name") for g in frames_of(a)}
    assert 'x<y>&"z' in names and "std::vector<int>::push_back" in names
    # an explicit id is used everywhere, the stylesheet is scoped to it
    svg = F.flame_svg(stacks, instance_id="cellA")
    assert ET.fromstring(svg).get("id") == "cellA" and "#cellA .mtf-f" in svg and iid not in svg
    for bad in ("1abc", "a b", "a\"b", ""):
        with pytest.raises(ValueError):
            F.flame_svg(stacks, instance_id=bad)


def test_svg_script_api_and_standalone_markup():
    svg = F.flame_svg(FOLDED, instance_id="fg1", title="T & t", subtitle="sub")
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg"') and "<?xml" not in svg
    root = ET.fromstring(svg)
    scripts = root.findall(f"{NS}script")
    assert len(scripts) == 1 and "<![CDATA[" in svg
    js = scripts[0].text
    assert '"id": "fg1"' in js and "document.documentElement" not in js
    for api in ("window.moetraceFlame = window.moetraceFlame || {}", "window.moetraceFlame[C.id]",
                "search: search", "zoom: zoom", "reset:", "frames:", "zoomedName:", "getElementById(C.id"):
        assert api in js
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", svg)  # no external resource
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "T & t" in texts and "sub" in texts and "Search" in texts and "Reset zoom" in texts


def test_frame_kinds_and_colors():
    kinds = {"do_syscall_64_[k]": "kernel", "[lost]_[k]": "other", "[unknown]": "other", "all": "other",
             "libc.so.6`preadv2": "native", "ld-linux-x86-64.so.2+0x80c4": "native",
             "python": "python", "python3.12`_PyEval_EvalFrameDefault": "python",
             "libpython3.12.so.1.0`PyObject_Call": "python", "python3.12+0x1234": "python",
             "_multiarray_umath.cpython-312-x86_64-linux-gnu.so`PyArray_Take": "python",
             "libarrow.so`_ZN5arrow": "native"}
    for name, kind in kinds.items():
        assert F.frame_kind(name) == kind, name

    def hue(c):
        import colorsys

        r, g, b = (int(x) / 255 for x in re.fullmatch(r"rgb\((\d+),(\d+),(\d+)\)", c).groups())
        return colorsys.rgb_to_hls(r, g, b)[0] * 360

    for kind, names in (("kernel", ["a_[k]", "b_[k]", "zz_[k]"]), ("native", ["libc.so.6`x", "liby`z"]),
                        ("python", ["python", "libpython3.so`Py_Main"])):
        lo, hi = F.PALETTE[kind][:2]
        for n in names:
            assert F.frame_color(n) == F.frame_color(n) and lo - 1 <= hue(F.frame_color(n)) <= hi + 1
    svg = F.flame_svg(FOLDED, min_width_px=0)
    fills = {g.get("data-name"): g.find(f"{NS}rect").get("fill") for g in frames_of(svg)}
    assert fills["do_syscall_64_[k]"] == F.frame_color("do_syscall_64_[k]") and fills["all"] == F.GREY


def test_empty_profile_draws_only_the_root():
    gs = frames_of(F.flame_svg(""))
    assert [(g.get("data-name"), g.get("data-samples")) for g in gs] == [("all", "0")]
    assert F.speedscope_json("")["profiles"][0]["weights"] == []


def test_writers(tmp_path):
    p = F.write_flame(FOLDED, tmp_path / "f.svg", title="x")
    assert p.read_text() == F.flame_svg(FOLDED, title="x")
    q = F.write_speedscope(FOLDED, tmp_path / "f.speedscope.json", name="n")
    assert json.loads(q.read_text()) == F.speedscope_json(FOLDED, name="n")


# ---------------------------------------------------------------------------
# speedscope


def check_speedscope(stacks: dict[str, int], doc: dict) -> None:
    doc = json.loads(json.dumps(doc))  # JSON-serializable, and round-trips
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    frames = doc["shared"]["frames"]
    assert all(set(f) == {"name"} for f in frames) and len({f["name"] for f in frames}) == len(frames)
    (prof,) = doc["profiles"]
    assert prof["type"] == "sampled" and len(prof["samples"]) == len(prof["weights"])
    assert prof["endValue"] - prof["startValue"] == sum(prof["weights"]) == sum(stacks.values())
    back = {}
    for sample, w in zip(prof["samples"], prof["weights"]):
        assert all(isinstance(i, int) and 0 <= i < len(frames) for i in sample)
        back[";".join(frames[i]["name"] for i in sample)] = w
    assert back == {s: n for s, n in stacks.items() if n > 0}


def test_speedscope():
    stacks = F.parse_folded(FOLDED)
    doc = F.speedscope_json(FOLDED, name="run")
    check_speedscope(stacks, doc)
    assert doc["name"] == doc["profiles"][0]["name"] == "run" and doc["activeProfileIndex"] == 0


# ---------------------------------------------------------------------------
# differential


def test_compute_flame_diff():
    a, b = F.parse_folded(FOLDED), F.parse_folded(FOLDED_B)
    df = F.compute_flame_diff(FOLDED, FOLDED_B)
    assert list(df.columns) == ["path", "frame", "depth", "samples_a", "samples_b", "share_a", "share_b",
                                "share_delta", "only_in"]
    assert list(df["path"]) == sorted(set(path_values(a)) | set(path_values(b)))
    ta, tb = sum(a.values()), sum(b.values())
    va, vb = path_values(a), path_values(b)
    for r in df.itertuples():
        assert (r.samples_a, r.samples_b) == (va.get(r.path, 0), vb.get(r.path, 0))
        assert r.frame == r.path.split(";")[-1] and r.depth == r.path.count(";")
        assert r.share_a == pytest.approx(r.samples_a / ta) and r.share_b == pytest.approx(r.samples_b / tb)
        assert r.share_delta == pytest.approx(r.share_b - r.share_a)
    only = dict(zip(df["path"], df["only_in"]))
    assert only["kswapd0"] == "a" and only["kswapd0;kthread_[k];kswapd_[k];shrink_node_[k]"] == "a"
    assert only["python;libc.so.6`malloc"] == "b" and pd.isna(only["python"])
    assert df["only_in"].notna().sum() == 5
    # shares of the first frames sum to 1 on each side, so their deltas sum to 0; a frame's delta is
    # its own (self) delta plus its children's
    top = df[df["depth"] == 0]
    assert top["share_a"].sum() == pytest.approx(1) and top["share_b"].sum() == pytest.approx(1)
    assert top["share_delta"].sum() == pytest.approx(0, abs=1e-12)
    delta = dict(zip(df["path"], df["share_delta"]))
    for p, d in delta.items():
        kids = [q for q in delta if q.startswith(p + ";") and ";" not in q[len(p) + 1:]]
        self_d = b.get(p, 0) / tb - a.get(p, 0) / ta
        assert d == pytest.approx(self_d + sum(delta[k] for k in kids), abs=1e-12)
    empty = F.compute_flame_diff("", FOLDED_B)
    assert (empty["only_in"] == "b").all() and (empty["share_a"] == 0).all()


def test_diff_svg():
    a, b = F.parse_folded(FOLDED), F.parse_folded(FOLDED_B)
    ta, tb = sum(a.values()), sum(b.values())
    svg = F.diff_flame_svg(a, b, label_a="base", label_b="new", min_width_px=0, instance_id="d1")
    assert F.diff_flame_svg(a, b, label_a="base", label_b="new", min_width_px=0, instance_id="d1") == svg
    assert ET.fromstring(svg).get("data-mode") == "diff"
    df = F.compute_flame_diff(a, b).set_index("path")
    gs = frames_of(svg)
    assert len(gs) == len(df) + 1
    inner = 1200 - 2 * F.PAD
    root = gs[0]
    assert (root.get("data-a"), root.get("data-b")) == (str(ta), str(tb)) and root.get("data-only") is None
    # rebuild each frame's path from the pre-order depths
    stack: list[str] = []
    for g in gs[1:]:
        d = int(g.get("data-depth"))
        stack[d - 1:] = [g.get("data-name")]
        r = df.loc[";".join(stack)]
        assert (int(g.get("data-a")), int(g.get("data-b")), int(g.get("data-samples"))) == (
            r.samples_a, r.samples_b, r.samples_b)
        assert g.get("data-only") == (None if pd.isna(r.only_in) else r.only_in)
        rect = g.find(f"{NS}rect")
        assert (rect.get("stroke-dasharray") is not None) == (g.get("data-only") is not None)
        # width = the mean of the two shares
        assert float(rect.get("width")) == pytest.approx((r.share_a + r.share_b) / 2 * inner, abs=0.006)
        red, green, blue = map(int, re.fullmatch(r"rgb\((\d+),(\d+),(\d+)\)", rect.get("fill")).groups())
        if r.share_delta > 1e-12:
            assert red == 255 and green == blue < 255
        elif r.share_delta < -1e-12:
            assert blue == 255 and red == green < 255
        tip = g.find(f"{NS}title").text
        assert f"base: {r.samples_a} samples" in tip and f"new: {r.samples_b} samples" in tip
        assert f"delta {100 * r.share_delta:+.2f} pp" in tip
    # the largest |delta| gets the most saturated color
    worst = df["share_delta"].abs().idxmax()
    assert worst in ("kswapd0", "python")
    js = ET.fromstring(svg).find(f"{NS}script").text
    assert '"la": "base"' in js and "window.moetraceFlame[C.id]" in js


# ---------------------------------------------------------------------------
# properties


frame = st.sampled_from(["python", "libc.so.6`read", "do_syscall_64_[k]", "vfs_read_[k]", "a", "b", "[unknown]"])
stacks_st = st.dictionaries(st.lists(frame, min_size=1, max_size=6).map(";".join), st.integers(0, 50), max_size=12)


@settings(max_examples=40, deadline=None)
@given(stacks_st, stacks_st)
def test_properties(a, b):
    check_tree(a)
    text = "".join(f"{s} {n}\n" for s, n in a.items())
    assert F.parse_folded(text) == a
    check_speedscope(a, F.speedscope_json(a))
    gs = frames_of(F.flame_svg(a, min_width_px=0))
    assert len(gs) == sum(1 for _ in F.build_tree(a).walk())
    df = F.compute_flame_diff(a, b)
    for side in ("a", "b"):
        tot = df.loc[df["depth"] == 0, f"share_{side}"].sum()
        assert tot == pytest.approx(1 if sum((a if side == "a" else b).values()) else 0)
    assert set(df.loc[df["only_in"] == "a", "path"]) == {p for p in path_values({k: v for k, v in a.items() if v})
                                                         if p not in path_values({k: v for k, v in b.items() if v})}
    dg = frames_of(F.diff_flame_svg(a, b, min_width_px=0))
    assert len(dg) == len(df) + 1


# ---------------------------------------------------------------------------
# the script, run by a headless Chromium (skipped when none is installed)


PROBE = r"""
var out = {errors: window.__errs || []};
try {
  for (var id in window.moetraceFlame) {
    var api = window.moetraceFlame[id], r = {};
    r.frames = api.frames(); r.visible0 = api.visible();
    r.futex = api.search("futex");
    r.nested = api.search("do_syscall_64_\\[k\\]|futex|preadv");
    r.regexp = api.search(/^python$/);
    r.matched = document.getElementById(id + "-matched").textContent;
    r.invalid = api.search("(");
    r.cleared = api.search("");
    r.zoom = api.zoom("do_syscall_64_[k]"); r.zoomed = api.zoomedName(); r.visible1 = api.visible();
    r.resetShown = !document.getElementById(id + "-reset").hasAttribute("display");
    var g = document.querySelector("#" + id + " g.mtf-f[data-name='do_syscall_64_[k]'] rect");
    r.zoomWidth = +g.getAttribute("width");
    var h = document.querySelector("#" + id + " g.mtf-f[data-i='1'] rect");
    h.dispatchEvent(new MouseEvent("mouseover", {bubbles: true}));
    r.status = document.getElementById(id + "-status").textContent;
    h.dispatchEvent(new MouseEvent("click", {bubbles: true}));
    r.clicked = api.zoomedName();
    api.reset(); r.reset = api.zoomedName(); r.visible2 = api.visible();
    r.missing = api.zoom("no such frame");
    out[id] = r;
  }
} catch (e) { out.errors.push(String(e)); }
var n = document.createElementNS("http://www.w3.org/2000/svg", "text");
n.textContent = "RESULT" + JSON.stringify(out) + "ENDRESULT";
(document.body || document.documentElement).appendChild(n);
"""
CATCH = 'window.__errs = []; window.addEventListener("error", function (e) { window.__errs.push(String(e.message)); });'


def run_browser(path) -> dict:
    """Load ``path`` in headless Chromium (tests/browser.py: a private profile and temp dir,
    nothing left behind) and return what the page's PROBE wrote."""
    from browser import Browser, require_browser

    require_browser()
    with Browser() as b, b.open(path) as page:
        text = page.evaluate("document.documentElement.textContent")
        m = re.search(r"RESULT(\{.*?\})ENDRESULT", text)
        assert m, text[-2000:]
        assert page.errors == [], page.errors
    out = json.loads(m.group(1))
    assert out.pop("errors") == []
    return out


def check_api(r: dict, n_frames: int, futex: float, nested: float, python: float, diff: bool) -> None:
    assert r["frames"] == r["visible0"] == r["visible2"] == n_frames
    assert r["futex"] == pytest.approx(futex) and r["nested"] == pytest.approx(nested)
    assert r["regexp"] == pytest.approx(python)
    assert r["matched"].startswith(f"Matched: {100 * python:.2f}%") and ("(a " in r["matched"]) == diff
    assert r["invalid"] is None and r["cleared"] == 0
    assert r["zoom"] is True and r["zoomed"] == "do_syscall_64_[k]" and r["resetShown"]
    assert r["zoomWidth"] == pytest.approx(1200 - 2 * F.PAD, abs=0.01)
    assert 0 < r["visible1"] < n_frames
    assert r["status"].startswith("kswapd0")
    assert r["clicked"] == "kswapd0" and r["reset"] is None and r["missing"] is False


def test_script_in_headless_browser(tmp_path):
    """Skips without chromium (fails under MOETRACE_LIVE=1, as the live tier does)."""
    a, b = F.parse_folded(FOLDED), F.parse_folded(FOLDED_B)

    def frac(stacks, rx):
        return sum(n for s, n in stacks.items() if any(re.search(rx, f) for f in s.split(";"))) / sum(stacks.values())

    nested_rx = r"do_syscall_64_\[k\]|futex|preadv"
    one = F.flame_svg(a, instance_id="one", min_width_px=0)
    two = F.diff_flame_svg(a, b, instance_id="two", min_width_px=0)
    # standalone: the SVG document itself, the probe appended as one more script
    svg = one.replace("<style>", f"<script><![CDATA[{CATCH}]]></script><style>", 1).replace(
        "</svg>\n", f"<script><![CDATA[{PROBE}]]></script></svg>\n")
    (tmp_path / "one.svg").write_text(svg)
    r = run_browser(tmp_path / "one.svg")
    check_api(r["one"], len(frames_of(one)), frac(a, "futex"), frac(a, nested_rx), frac(a, "^python$"), False)
    # inlined: both graphs in one HTML page
    html = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>t</title><script>{CATCH}</script></head>"
            f"<body><h1>flame</h1>{one}<p>and the diff</p>{two}<script>{PROBE}</script></body></html>")
    (tmp_path / "page.html").write_text(html)
    r = run_browser(tmp_path / "page.html")
    assert set(r) == {"one", "two"}
    check_api(r["one"], len(frames_of(one)), frac(a, "futex"), frac(a, nested_rx), frac(a, "^python$"), False)

    def mean(rx):
        return (frac(a, rx) + frac(b, rx)) / 2

    check_api(r["two"], len(frames_of(two)), mean("futex"), mean(nested_rx), mean("^python$"), True)
