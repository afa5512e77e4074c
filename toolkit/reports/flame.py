"""Flame graphs drawn by moetrace itself: folded stacks in, a standalone interactive SVG (or a
speedscope file, or a differential flame graph of two profiles) out.

Input is Brendan Gregg's folded format (``frame;frame;...;leaf COUNT``, root first; the stacks
probe writes ``stacks.folded``) or a table with columns ``stack`` and ``samples``; every public
function taking ``stacks`` accepts the text, such a DataFrame, or a ``{stack: samples}`` mapping.

Layout: root at the bottom (a classic flame graph, not an icicle). The bottom frame ``all`` is
the synthetic root (every sample); above it the first frame of each stack (the comm), then its
callees. Siblings are ordered by name (not by sample count), so the same input always gives
the same picture, byte for byte. A frame narrower than ``min_width_px`` is not drawn, nor
anything above it (it cannot be wider than its parent).

Colors: a hue family per frame kind (:func:`frame_kind`): kernel frames (``_[k]``) orange,
Python/interpreter frames green, other user/native frames blue, ``all`` and ``[unknown]``
style placeholders grey; the shade within the family comes from an MD5 of the name (no
randomness). Search matches are magenta.

Interaction (an embedded, CDATA-wrapped plain-JS ``<script>``; no external resources): hover a
frame to see its tooltip text in the status line at the bottom; click a frame to zoom (it fills
the width, frames above it are rescaled, its ancestors stay drawn full-width and faded, all
others are hidden); "Reset zoom" (top left, shown while zoomed) undoes it; "Search" (top right)
prompts for a JavaScript regular expression, paints the matching frames magenta and shows
"Matched: X%": the samples under at least one matching frame (a sample below two nested
matches counts once; the ``all`` root is never matched; frames too narrow to be drawn are not
searched). Clicking the control again ("Clear search") clears it.

Inlining: every id in the document is prefixed with the instance id (the ``<svg>``'s own id;
by default ``mtf-`` + a hash of the content and options), the stylesheet's selectors are
scoped to it, and the script finds its elements with ``document.getElementById(<id>...)``,
so several graphs can be pasted into one HTML page (as markup: scripts inserted through
``innerHTML`` do not run). Each graph registers ``window.moetraceFlame[<id>]`` with
``search(re) -> fraction | null`` (null: invalid regex; "" clears), ``zoom(index | name |
element) -> bool`` (a name zooms to the widest frame of that name), ``reset()``,
``frames()`` (frames drawn in the document), ``visible()`` (frames shown now) and
``zoomedName()`` (null when not zoomed).

Every frame is ``<g class="mtf-f" data-i data-name data-samples data-depth data-start data-v>``
holding ``<title>`` (tooltip), ``<rect>`` and ``<text>`` (the name, truncated with ``..`` to
fit, assuming a monospace advance of 0.6 em). ``data-start``/``data-v`` are the frame's
position and width in integer layout units (samples for a flame graph).

Differential graphs (:func:`diff_flame_svg`): the merged tree of both profiles, each frame as
wide as the MEAN of its two shares, (share_a + share_b) / 2, so frames present on one side
only are still drawn (at half their share there) and widths stay exactly additive; red where
the frame's inclusive share grew in b, blue where it shrank, saturation by |delta| relative to
the largest |delta| drawn; frames on one side only have a dashed outline and ``data-only="a"``
or ``"b"``. ``data-samples`` is b's count; ``data-a``/``data-b`` both counts. The search's
"Matched" shows the fraction of the layout and of each side's samples.
"""

from __future__ import annotations

import colorsys
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from moetrace.errors import InputError

if TYPE_CHECKING:
    import pandas as pd

#: what the functions accept as a profile: folded text, a stack/samples table, or a mapping
Stacks = Union[str, Mapping[str, int], "pd.DataFrame"]

SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"
ROOT = "all"
PAD = 10  # px left and right of the frames
CHAR_EM = 0.6  # advance of a monospace glyph, in em
FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
HIGHLIGHT = "rgb(220,0,220)"
GREY = "rgb(200,200,200)"
#: hue range (degrees), saturation, lightness range of each frame kind
PALETTE = {"kernel": (15, 40, 0.85, 0.55, 0.68), "python": (90, 135, 0.55, 0.50, 0.64),
           "native": (195, 225, 0.70, 0.66, 0.78)}
_COUNT = re.compile(r"[0-9]+")
_IID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_PY_MODULE = re.compile(r"(lib)?python[0-9.]*[a-z]?(\.so[0-9.]*)?", re.I)
_PY_SYMBOL = re.compile(r"_?Py[A-Z_]")
_BAD_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


# -- input -----------------------------------------------------------------------------------

def parse_folded(text: str, source: str = "<folded>") -> dict[str, int]:
    """``{stack: samples}`` from folded text; duplicate stacks are summed, blank lines skipped.

    A line is ``frame;frame;...;leaf COUNT`` (the count after the last whitespace, a
    non-negative integer; frame names may contain spaces but no ``;``). A malformed line
    raises :class:`~moetrace.errors.InputError` naming ``source`` and the 1-based line."""
    out: dict[str, int] = {}
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line:
            continue
        parts = line.rsplit(None, 1)
        if len(parts) < 2:
            raise InputError(f"no sample count in {_clip(line)!r}", path=source, line=lineno,
                             hint="a folded line is `frame;frame;...;leaf COUNT`")
        stack, count = parts[0].rstrip(), parts[1]
        if not _COUNT.fullmatch(count):
            raise InputError(f"sample count {_clip(count)!r} is not a non-negative integer",
                             path=source, line=lineno, hint="a folded line is `frame;frame;...;leaf COUNT`")
        if any(not f for f in stack.split(";")):
            raise InputError(f"empty frame name in {_clip(stack)!r}", path=source, line=lineno,
                             hint="frames are separated by single ';'")
        out[stack] = out.get(stack, 0) + int(count)
    return out


def folded_from_table(df: pd.DataFrame, source: str = "<table>") -> dict[str, int]:
    """``{stack: samples}`` from a table with columns ``stack`` (folded, ``;``-joined) and
    ``samples`` (non-negative integers), duplicates summed; bad rows raise InputError."""
    missing = [c for c in ("stack", "samples") if c not in df.columns]
    if missing:
        raise InputError(f"a stacks table needs columns stack and samples; missing {', '.join(missing)}",
                         path=source)
    out: dict[str, int] = {}
    for row, (stack, n) in enumerate(zip(df["stack"].tolist(), df["samples"].tolist())):
        if not isinstance(stack, str) or not stack or any(not f for f in stack.split(";")):
            raise InputError(f"row {row}: bad stack {stack!r}", path=source)
        try:
            ok = float(n).is_integer() and n >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"row {row}: samples {n!r} is not a non-negative integer", path=source)
        out[stack] = out.get(stack, 0) + int(n)
    return out


def _stacks(stacks: Stacks) -> dict[str, int]:
    if isinstance(stacks, str):
        return parse_folded(stacks)
    if isinstance(stacks, Mapping):
        return {str(k): int(v) for k, v in stacks.items()}
    if hasattr(stacks, "columns"):
        return folded_from_table(stacks)
    raise TypeError(f"stacks must be folded text, a mapping or a DataFrame, not {type(stacks).__name__}")


def _clip(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


# -- the tree --------------------------------------------------------------------------------

@dataclass
class Node:
    """A frame of the merged call tree: ``value`` = samples through it (inclusive),
    ``self_value`` = samples ending in it; ``children`` ordered by name."""

    name: str
    value: int = 0
    self_value: int = 0
    children: list[Node] = field(default_factory=list)

    def walk(self) -> Iterator[tuple[Node, int, str]]:
        """Pre-order ``(node, depth, path)``: this node at depth 0 with path ``""``, below it
        the ``;``-joined frame names from the first frame under it."""
        todo: list[tuple[Node, int, str]] = [(self, 0, "")]
        while todo:
            node, depth, path = todo.pop()
            yield node, depth, path
            for c in reversed(node.children):
                todo.append((c, depth + 1, f"{path};{c.name}" if path else c.name))


def build_tree(stacks: Mapping[str, int]) -> Node:
    """The call tree of ``{stack: samples}`` under a root named ``all``; stacks with no
    samples are left out."""
    root = Node(ROOT)
    kids: dict[int, dict[str, Node]] = {}
    for stack, n in stacks.items():
        n = int(n)
        if n < 0:
            raise ValueError(f"negative sample count {n} for {stack!r}")
        if n == 0 or not stack:
            continue
        node = root
        node.value += n
        for name in stack.split(";"):
            index = kids.setdefault(id(node), {})
            child = index.get(name)
            if child is None:
                child = index[name] = Node(name)
                node.children.append(child)
            child.value += n
            node = child
        node.self_value += n
    for node, _, _ in root.walk():
        node.children.sort(key=lambda c: c.name)
    return root


def _inclusive(tree: Node) -> dict[str, int]:
    return {path: node.value for node, _, path in tree.walk()}


# -- colors ----------------------------------------------------------------------------------

def frame_kind(name: str) -> str:
    """``kernel`` (``..._[k]``), ``python`` (python/libpython modules, ``Py``/``_Py`` symbols,
    ``.py`` frames), ``native`` (other user frames) or ``other`` (``all``, ``[unknown]``...)."""
    if name == ROOT or name.startswith("["):
        return "other"
    if name.endswith("_[k]"):
        return "kernel"
    module, _, symbol = name.partition("`")
    module = module.split("+0x", 1)[0]
    if (_PY_MODULE.fullmatch(module) or _PY_SYMBOL.match(symbol or name)
            or re.search(r"\.py\b", name)):
        return "python"
    return "native"


def frame_color(name: str) -> str:
    """The frame's fill: its kind's hue family, the shade from an MD5 of the name."""
    kind = frame_kind(name)
    if kind == "other":
        return GREY
    h0, h1, sat, l0, l1 = PALETTE[kind]
    d = hashlib.md5(name.encode("utf-8", "surrogatepass")).digest()
    u, v = int.from_bytes(d[:2], "big") / 65535, int.from_bytes(d[2:4], "big") / 65535
    r, g, b = colorsys.hls_to_rgb((h0 + u * (h1 - h0)) / 360, l0 + v * (l1 - l0), sat)
    return f"rgb({round(r * 255)},{round(g * 255)},{round(b * 255)})"


def _diff_color(delta: float, maxabs: float) -> str:
    if delta == 0 or maxabs <= 0:
        return "rgb(235,235,235)"
    c = round(235 - 150 * min(1.0, abs(delta) / maxabs))
    return f"rgb(255,{c},{c})" if delta > 0 else f"rgb({c},{c},255)"


# -- drawing ---------------------------------------------------------------------------------

@dataclass
class _Box:
    name: str
    depth: int
    start: int  # layout units
    v: int
    fill: str
    tip: str
    attrs: dict[str, Any]
    dashed: bool = False


def _layout(tree: Node, inner: float, min_px: float) -> Iterator[tuple[Node, int, int, str]]:
    """Pre-order ``(node, depth, start, path)`` of the frames at least ``min_px`` wide."""
    scale = inner / max(tree.value, 1)
    todo: list[tuple[Node, int, int, str]] = [(tree, 0, 0, "")]
    while todo:
        node, depth, start, path = todo.pop()
        yield node, depth, start, path
        placed, s = [], start
        for c in node.children:
            if c.value * scale >= min_px:
                placed.append((c, depth + 1, s, f"{path};{c.name}" if path else c.name))
            s += c.value
        todo.extend(reversed(placed))


def _esc(s: Any) -> str:
    s = _BAD_XML.sub("\ufffd", str(s))
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _n(x: float) -> str:
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("", "-0") else s


def _fit(name: str, w: float, cw: float) -> str:
    n = int((w - 6) // cw)
    if n < 3:
        return ""
    return name if len(name) <= n else name[: n - 2] + ".."


def _instance_id(instance_id: str | None, *content: Any) -> str:
    if instance_id is None:
        return "mtf-" + hashlib.sha1(repr(content).encode("utf-8", "surrogatepass")).hexdigest()[:12]
    if not _IID.fullmatch(instance_id):
        raise ValueError(f"instance_id {instance_id!r}: use a letter, then letters, digits, '-' or '_'")
    return instance_id


def _render(boxes: list[_Box], total: int, *, title: str, subtitle: str, width: int, frame_height: int,
            iid: str, mode: str, idle: str, cfg: dict[str, Any]) -> str:
    inner, fh = width - 2 * PAD, frame_height
    font = max(6.0, min(12.0, fh * 0.75))
    cw = CHAR_EM * font
    top = 50 + (16 if subtitle else 0)
    height = top + (max(b.depth for b in boxes) + 1) * fh + 30
    base = height - 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" id="{iid}" class="moetrace-flame" '
        f'data-mode="{mode}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="{FONT}" font-size="{_n(font)}">',
        f"<style><![CDATA[#{iid} .mtf-f{{cursor:pointer}} #{iid} .mtf-f:hover rect{{stroke:#000;stroke-width:1}} "
        f"#{iid} .mtf-anc rect{{opacity:.55}} #{iid} .mtf-ctl{{cursor:pointer;fill:#1558b0}} "
        f"#{iid} .mtf-f text{{pointer-events:none;fill:#000}}]]></style>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa"/>',
        f'<text x="{width / 2:g}" y="24" text-anchor="middle" font-size="17">{_esc(title)}</text>',
    ]
    if subtitle:
        out.append(f'<text x="{width / 2:g}" y="42" text-anchor="middle" fill="#555">{_esc(subtitle)}</text>')
    out += [
        f'<text id="{iid}-reset" class="mtf-ctl" x="{PAD}" y="24" display="none">Reset zoom</text>',
        f'<text id="{iid}-search" class="mtf-ctl" x="{width - PAD}" y="24" text-anchor="end">Search</text>',
        f'<text id="{iid}-status" x="{PAD}" y="{height - 10}" fill="#333">{_esc(_fit(idle, inner, cw))}</text>',
        f'<text id="{iid}-matched" x="{width - PAD}" y="{height - 10}" text-anchor="end" fill="#333"></text>',
        f'<g id="{iid}-frames">',
    ]
    scale = inner / max(total, 1)
    for i, b in enumerate(boxes):
        x, w, y = PAD + b.start * scale, b.v * scale, base - (b.depth + 1) * fh
        attrs = "".join(f' {k}="{_esc(v)}"' for k, v in b.attrs.items())
        dash = ' stroke="#222" stroke-width="0.8" stroke-dasharray="3,2"' if b.dashed else ""
        out.append(
            f'<g class="mtf-f" data-i="{i}" data-name="{_esc(b.name)}"{attrs} data-depth="{b.depth}" '
            f'data-start="{b.start}" data-v="{b.v}"><title>{_esc(b.tip)}</title>'
            f'<rect x="{_n(x)}" y="{y}" width="{_n(w)}" height="{fh - 1}" rx="2" fill="{b.fill}"{dash}/>'
            f'<text x="{_n(x + 3)}" y="{_n(y + (fh - 1) / 2 + font * 0.35)}">{_esc(_fit(b.name, w, cw))}</text></g>')
    cfg = dict(cfg, id=iid, mode=mode, w=inner, pad=PAD, cw=cw, hl=HIGHLIGHT)
    js_cfg = json.dumps(cfg, sort_keys=True, ensure_ascii=True).replace("<", "\\u003c").replace(">", "\\u003e")
    out += ["</g>", f"<script><![CDATA[\n{_SCRIPT.replace('__CFG__', js_cfg)}]]></script>", "</svg>"]
    return "\n".join(out) + "\n"


_SCRIPT = r"""(function () {
  "use strict";
  var C = __CFG__;
  var svg = document.getElementById(C.id);
  if (!svg || svg.getAttribute("data-mtf-ready")) return;
  svg.setAttribute("data-mtf-ready", "1");
  var el = function (s) { return document.getElementById(C.id + "-" + s); };
  var status = el("status"), matched = el("matched"), resetB = el("reset"), searchB = el("search");
  var idle = status.textContent, fr = [], nodes = svg.querySelectorAll("g.mtf-f"), zoomed = null, active = false;
  for (var i = 0; i < nodes.length; i++) {
    var g = nodes[i], r = g.querySelector("rect");
    fr.push({g: g, r: r, t: g.querySelector("text"), name: g.getAttribute("data-name"),
             tip: g.querySelector("title").textContent, fill: r.getAttribute("fill"),
             d: +g.getAttribute("data-depth"), s: +g.getAttribute("data-start"), v: +g.getAttribute("data-v"),
             a: +g.getAttribute("data-a"), b: +g.getAttribute("data-b")});
  }
  var root = fr[0], eps = root.v * 1e-12;
  function fit(s, w) {
    var n = Math.floor((w - 6) / C.cw);
    return n < 3 ? "" : (s.length <= n ? s : s.slice(0, n - 2) + "..");
  }
  function place(f, x, w) {
    f.r.setAttribute("x", x.toFixed(2)); f.r.setAttribute("width", w.toFixed(2));
    f.t.setAttribute("x", (x + 3).toFixed(2)); f.t.textContent = fit(f.name, w);
  }
  function show(f, on) { if (on) f.g.removeAttribute("display"); else f.g.setAttribute("display", "none"); }
  function find(x) {
    var k, best = null;
    if (typeof x === "number") return fr[x] || null;
    for (k = 0; k < fr.length; k++) {
      if (x && x.nodeType) { if (fr[k].g === x) return fr[k]; continue; }
      if (fr[k].name === String(x) && (!best || fr[k].v > best.v)) best = fr[k];
    }
    return best;
  }
  function zoom(x) {
    var z = find(x);
    if (!z) return false;
    for (var k = 0; k < fr.length; k++) {
      var f = fr[k];
      if (f.d >= z.d && f.s >= z.s - eps && f.s + f.v <= z.s + z.v + eps) {
        place(f, C.pad + (f.s - z.s) / z.v * C.w, f.v / z.v * C.w);
        f.g.classList.remove("mtf-anc"); show(f, true);
      } else if (f.d < z.d && f.s <= z.s + eps && f.s + f.v >= z.s + z.v - eps) {
        place(f, C.pad, C.w); f.g.classList.add("mtf-anc"); show(f, true);
      } else show(f, false);
    }
    zoomed = z === root ? null : z;
    if (zoomed) resetB.removeAttribute("display"); else resetB.setAttribute("display", "none");
    return true;
  }
  function pct(x) { return (100 * x).toFixed(2) + "%"; }
  function clear() {
    for (var k = 0; k < fr.length; k++) {
      fr[k].r.setAttribute("fill", fr[k].fill); fr[k].g.removeAttribute("data-match");
    }
    matched.textContent = ""; searchB.textContent = "Search"; active = false;
  }
  function search(q) {
    var rx, hits = [], k;
    if (q === undefined || q === null || q === "") { clear(); return 0; }
    try { rx = q instanceof RegExp ? q : new RegExp(String(q)); }
    catch (e) { status.textContent = fit("Invalid regular expression: " + q, C.w); return null; }
    clear();
    for (k = 1; k < fr.length; k++) {
      rx.lastIndex = 0;
      if (!rx.test(fr[k].name)) continue;
      hits.push(fr[k]); fr[k].r.setAttribute("fill", C.hl); fr[k].g.setAttribute("data-match", "1");
    }
    hits.sort(function (p, q) { return p.s - q.s || p.d - q.d; });
    var end = -Infinity, sv = 0, sa = 0, sb = 0;
    for (k = 0; k < hits.length; k++) {
      var h = hits[k];
      if (h.s < end - eps) continue;  /* inside a match already counted */
      end = h.s + h.v; sv += h.v; sa += h.a; sb += h.b;
    }
    var frac = root.v > 0 ? sv / root.v : 0;
    matched.textContent = "Matched: " + pct(frac) + (C.mode === "diff" ?
      " (" + C.la + " " + pct(sa / (C.ta || 1)) + ", " + C.lb + " " + pct(sb / (C.tb || 1)) + ")" : "");
    searchB.textContent = "Clear search"; active = true;
    return frac;
  }
  function frameOf(e) {
    for (var n = e.target; n && n !== svg; n = n.parentNode)
      if (n.classList && n.classList.contains("mtf-f")) return n;
    return null;
  }
  svg.addEventListener("mouseover", function (e) {
    var g = frameOf(e); if (g) status.textContent = fit(find(g).tip, C.w);
  });
  svg.addEventListener("mouseout", function (e) { if (frameOf(e)) status.textContent = idle; });
  svg.addEventListener("click", function (e) { var g = frameOf(e); if (g) zoom(g); });
  resetB.addEventListener("click", function () { zoom(0); });
  searchB.addEventListener("click", function () {
    if (active) { clear(); return; }
    var q = window.prompt("Search frames (regular expression)", "");
    if (q) search(q);
  });
  window.moetraceFlame = window.moetraceFlame || {};
  window.moetraceFlame[C.id] = {
    search: search, zoom: zoom, reset: function () { zoom(0); }, frames: function () { return fr.length; },
    visible: function () {
      var n = 0; for (var k = 0; k < fr.length; k++) if (!fr[k].g.hasAttribute("display")) n++; return n;
    },
    zoomedName: function () { return zoomed ? zoomed.name : null; }
  };
})();
"""


# -- public drawing functions ----------------------------------------------------------------

def flame_svg(stacks: Stacks, *, title: str = "Flame graph", width: int = 1200, frame_height: int = 16,
              min_width_px: float = 0.1, instance_id: str | None = None, subtitle: str = "") -> str:
    """A standalone interactive flame graph (root at the bottom) as an SVG document string,
    also valid inlined into HTML; see the module docstring for layout, colors and the JS API.
    Same input and options give a byte-identical document."""
    st = _stacks(stacks)
    tree = build_tree(st)
    total = tree.value
    iid = _instance_id(instance_id, "flame", sorted(st.items()), title, subtitle, width, frame_height, min_width_px)
    boxes = []
    for node, depth, start, _ in _layout(tree, width - 2 * PAD, min_width_px):
        pct = 100 * node.value / total if total else 0.0
        boxes.append(_Box(node.name, depth, start, node.value if total else 1,
                          frame_color(node.name) if depth else GREY,
                          f"{node.name} ({node.value} samples, {pct:.2f}%)",
                          {"data-samples": node.value, "data-self": node.self_value,
                           "data-kind": frame_kind(node.name)}))
    idle = f"{total} samples - hover a frame for details, click to zoom"
    return _render(boxes, total, title=title, subtitle=subtitle, width=width, frame_height=frame_height,
                   iid=iid, mode="flame", idle=idle, cfg={})


def _merged(sa: dict[str, int], sb: dict[str, int]) -> tuple[Node, dict[str, int], dict[str, int], int, int]:
    """The merged tree in integer layout units (a*max(tb,1) + b*max(ta,1): proportional to
    share_a + share_b, exactly additive) and each side's inclusive counts by path."""
    ia, ib = _inclusive(build_tree(sa)), _inclusive(build_tree(sb))
    ta, tb = ia[""], ib[""]
    ua, ub = max(tb, 1), max(ta, 1)
    units = {s: max(sa.get(s, 0), 0) * ua + max(sb.get(s, 0), 0) * ub for s in set(sa) | set(sb)}
    return build_tree(units), ia, ib, ta, tb


def compute_flame_diff(a: Stacks, b: Stacks) -> pd.DataFrame:
    """One row per frame path (``;``-joined prefix, depth 0 = the first frame) with samples on
    either side: ``path, frame, depth, samples_a, samples_b`` (inclusive), ``share_a, share_b``
    (of each side's total; 0 when a side is empty), ``share_delta`` (b - a), ``only_in``
    ('a', 'b' or NA); sorted by path."""
    import pandas as pd

    ia, ib = _inclusive(build_tree(_stacks(a))), _inclusive(build_tree(_stacks(b)))
    ta, tb = ia.pop(""), ib.pop("")
    paths = sorted(set(ia) | set(ib))
    na = [ia.get(p, 0) for p in paths]
    nb = [ib.get(p, 0) for p in paths]
    df = pd.DataFrame({
        "path": pd.array(paths, dtype="string"),
        "frame": pd.array([p.rsplit(";", 1)[-1] for p in paths], dtype="string"),
        "depth": pd.array([p.count(";") for p in paths], dtype="int64"),
        "samples_a": pd.array(na, dtype="int64"), "samples_b": pd.array(nb, dtype="int64"),
        "share_a": [x / ta if ta else 0.0 for x in na], "share_b": [x / tb if tb else 0.0 for x in nb],
    })
    df["share_delta"] = df["share_b"] - df["share_a"]
    df["only_in"] = pd.array(["a" if y == 0 else "b" if x == 0 else None for x, y in zip(na, nb)], dtype="string")
    return df


def diff_flame_svg(a: Stacks, b: Stacks, *, label_a: str = "a", label_b: str = "b",
                   title: str = "Differential flame graph", width: int = 1200, frame_height: int = 16,
                   min_width_px: float = 0.1, instance_id: str | None = None, subtitle: str = "") -> str:
    """A differential flame graph of ``b`` against ``a``: the merged tree, each frame as wide
    as the mean of its two shares; red = larger inclusive share in b, blue = smaller
    (saturation by |delta| / largest |delta|), dashed outline + ``data-only`` = one side only.
    Tooltips give both counts and shares and the delta in percentage points."""
    sa, sb = _stacks(a), _stacks(b)
    tree, ia, ib, ta, tb = _merged(sa, sb)
    iid = _instance_id(instance_id, "diff", sorted(sa.items()), sorted(sb.items()), label_a, label_b, title,
                       subtitle, width, frame_height, min_width_px)
    rows = []
    for node, depth, start, path in _layout(tree, width - 2 * PAD, min_width_px):
        na, nb = ia.get(path, 0), ib.get(path, 0)
        pa, pb = (na / ta if ta else 0.0), (nb / tb if tb else 0.0)
        rows.append((node, depth, start, na, nb, pa, pb, pb - pa))
    maxabs = max((abs(r[7]) for r in rows[1:]), default=0.0)
    boxes = []
    for node, depth, start, na, nb, pa, pb, d in rows:
        only = "a" if depth and nb == 0 else "b" if depth and na == 0 else None
        side = f" | only in {label_a if only == 'a' else label_b}" if only else ""
        tip = (f"{node.name} | {label_a}: {na} samples ({100 * pa:.2f}%) | {label_b}: {nb} samples "
               f"({100 * pb:.2f}%) | delta {100 * d:+.2f} pp{side}")
        attrs: dict[str, Any] = {"data-samples": nb, "data-a": na, "data-b": nb, "data-delta": f"{d:.6f}"}
        if only:
            attrs["data-only"] = only
        boxes.append(_Box(node.name, depth, start, node.value if tree.value else 1,
                          _diff_color(d, maxabs) if depth else GREY, tip, attrs, dashed=only is not None))
    idle = (f"{label_b} vs {label_a}: red = larger share in {label_b}, blue = smaller; dashed = one side only; "
            f"width = mean share; click to zoom")
    return _render(boxes, tree.value, title=title, subtitle=subtitle, width=width, frame_height=frame_height,
                   iid=iid, mode="diff", idle=idle, cfg={"ta": ta, "tb": tb, "la": label_a, "lb": label_b})


def speedscope_json(stacks: Stacks, name: str = "moetrace") -> dict[str, Any]:
    """A speedscope file (https://www.speedscope.app/file-format-schema.json): one ``sampled``
    profile, a sample per distinct stack (frame indices, root first) weighted by its count."""
    st = _stacks(stacks)
    index: dict[str, int] = {}
    frames: list[dict[str, str]] = []
    samples: list[list[int]] = []
    weights: list[int] = []
    for stack in sorted(st):
        n = int(st[stack])
        if n <= 0 or not stack:
            continue
        ids = []
        for f in stack.split(";"):
            if f not in index:
                index[f] = len(frames)
                frames.append({"name": f})
            ids.append(index[f])
        samples.append(ids)
        weights.append(n)
    return {"$schema": SPEEDSCOPE_SCHEMA, "shared": {"frames": frames},
            "profiles": [{"type": "sampled", "name": name, "unit": "none", "startValue": 0,
                          "endValue": sum(weights), "samples": samples, "weights": weights}],
            "name": name, "activeProfileIndex": 0, "exporter": "moetrace"}


def write_flame(stacks: Stacks, path: str | Path, **kw: Any) -> Path:
    """Write :func:`flame_svg` (keyword options passed on) to ``path``; returns it."""
    path = Path(path)
    path.write_text(flame_svg(stacks, **kw), encoding="utf-8")
    return path


def write_speedscope(stacks: Stacks, path: str | Path, name: str = "moetrace") -> Path:
    """Write :func:`speedscope_json` to ``path``; returns it."""
    path = Path(path)
    path.write_text(json.dumps(speedscope_json(stacks, name), separators=(",", ":")) + "\n", encoding="utf-8")
    return path
