"""Render the lru_gen fixtures of this folder with the kernel's own printf formats.

Run from the repository root: python tests/data/lru_gen/make_fixtures.py

The formats are copied from lru_gen_seq_show() / lru_gen_seq_show_full() in mm/vmscan.c:
6.1 (linux-6.1.y) and 6.12 (6.12 with "mm: multi-gen LRU: remove MM_LEAF_OLD and
MM_NONLEAF_TOTAL stats", merged as an mm hotfix for 6.12-rc, which also changed the blank
markers to 'x'). The numbers of the short files are the real samples recorded in the
kernel lab (README.md, "Kernel lab": Debian 6.1.0-47 with MGLRU on, and 6.12.95 with an mmap
reader); the full files re-use those generations and add plausible tier / walk counters
(no real lru_gen_full sample was recorded). C's "%10lu%c" is Python's "%10d%s".
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
MAX_NR_TIERS = 4


def memcg(mid: int, path: str) -> str:
    return "memcg %5d %s\n" % (mid, path)  # "memcg %5hu %s\n"


def node(nid: int) -> str:
    return " node %5d\n" % nid  # " node %5d\n"


def gen_line(seq: int, age: int, anon: int, file: int, marks: str = "  ") -> str:
    # " %10lu %10u" then per type " %10lu%c"
    return " %10d %10d" % (seq, age) + " %10d%s" % (anon, marks[0]) + " %10d%s" % (file, marks[1]) + "\n"


def tier_line(tier: int, per_type: list[tuple[tuple[int, int, int], str]]) -> str:
    s = "            %10d" % tier  # "            %10d"
    for n, marks in per_type:
        for v, c in zip(n, marks):
            s += " %10d%s" % (v, c)  # " %10lu%c"
    return s + "\n"


def walk_line(vals: list[int], marks: str) -> str:
    s = "                      "  # seq_puts(m, "                      ")
    for v, c in zip(vals, marks):
        s += " %10d%s" % (v, c)
    return s + "\n"


def header(lines: list[str]) -> str:
    return "".join(f"# {x}\n" for x in lines)


# -- short format: the real lab samples ------------------------------------------------------

SHORT_61 = [(1, "/", 0, [(0, 65272, 0, 0), (3, 65272, 5072, 36786)]),
            (2, "/moe", 0, [(10, 1924, 0, 0), (11, 1924, 0, 29492), (12, 1564, 0, 37934), (13, 1224, 0, 29223)])]
SHORT_612 = [(2, "/moe", 0, [(5, 10600, 0, 0), (6, 676, 2, 42038), (7, 676, 1021, 34956), (8, 356, 0, 18973)])]


def short(blocks, src: str) -> str:
    out = header([f"lru_gen (short format) of {src}, recorded in the kernel lab (README.md, \"Kernel lab\").",
                  "Rendered with lru_gen_seq_show()'s formats: \"memcg %5hu %s\", \" node %5d\",",
                  "\" %10lu %10u\" + 2 x \" %10lu%c\" (mark ' ' outside lru_gen_full).",
                  "Columns of a generation line: seq, age_ms, nr_anon_pages, nr_file_pages."])
    for mid, path, nid, gens in blocks:
        out += memcg(mid, path) + node(nid)
        for g in gens:
            out += gen_line(*g)
    return out


# -- full format ------------------------------------------------------------------------------

def full(version: str) -> str:
    """One memcg (/moe, id 2, 2 nodes) in the full format of 6.1 or 6.12."""
    v61 = version == "6.1"
    blank3 = "   " if v61 else "xxx"
    avg = "RT " if v61 else "RTx"
    out = header([f"lru_gen_full of Linux {version}, rendered with lru_gen_seq_show{{,_full}}()'s formats "
                  "(mm/vmscan.c).",
                  "Generations from the real lab sample (README.md, \"Kernel lab\"); tier and walk counters plausible",
                  "values (no real lru_gen_full was recorded). Full format: the last MAX_NR_GENS (4)",
                  "generations, 'x' after a count when seq < min_seq[type]; after each generation",
                  f"MAX_NR_TIERS (4) tier lines (markers {avg.strip()!r} at max_seq, 'rep' at min_seq[type],",
                  f"{blank3!r} elsewhere) and one walk line (" +
                  ("6.1: L O Y N F A at max_seq, blanks elsewhere)" if v61 else
                   "6.12: T Y F A at max_seq, 'x' elsewhere)"),
                  "node 1 is a second NUMA node (synthesized) to exercise multi-node output."])
    if v61:
        gens = [(10, 1924, 0, 0), (11, 1924, 0, 29492), (12, 1564, 0, 37934), (13, 1224, 0, 29223)]
    else:
        gens = [(5, 10600, 0, 0), (6, 676, 2, 42038), (7, 676, 1021, 34956), (8, 356, 0, 18973)]
    max_seq = gens[-1][0]
    min_seq = {"anon": gens[0][0], "file": gens[1][0]}  # the oldest file generation is already evicted
    out += memcg(2, "/moe")
    for nid, scale in ((0, 1), (1, 0)):  # node 1: empty generations, young timestamps
        out += node(nid)
        for seq, age, anon, file in gens:
            marks = ("x" if seq < min_seq["anon"] else " ") + ("x" if seq < min_seq["file"] else " ")
            out += gen_line(seq, age if scale else 12, anon * scale, file * scale, marks)
            for tier in range(MAX_NR_TIERS):
                per = []
                for typ in ("anon", "file"):
                    if seq == max_seq:
                        n, mk = ((tier * 3 * scale, (tier + 1) * 1500 * scale, 0), avg)
                    elif seq == min_seq[typ]:
                        n, mk = ((tier * 7 * scale, (40 - tier * 9) * 100 * scale, (tier * 11 * scale) if tier else 0),
                                 "rep")
                    else:
                        n, mk = ((0, 0, 0), blank3)
                    per.append((n, mk))
                out += tier_line(tier, per)
            if v61:
                vals = [118_532 * scale, 96_310 * scale, 22_222 * scale, 3_410 * scale, 512 * scale, 2_061 * scale]
                out += walk_line(vals if seq == max_seq else [0] * 6, "LOYNFA" if seq == max_seq else "      ")
            else:
                vals = [84_220 * scale, 19_004 * scale, 377 * scale, 1_950 * scale]
                out += walk_line(vals if seq == max_seq else [0] * 4, "TYFA" if seq == max_seq else "xxxx")
    return out


def main() -> None:
    (HERE / "6.1_lru_gen.txt").write_text(short(SHORT_61, "Debian 6.1.0-47-amd64 (MGLRU on)"))
    (HERE / "6.12_lru_gen.txt").write_text(short(SHORT_612, "Debian 6.12.95+deb12-amd64 (MGLRU on by default)"))
    (HERE / "6.1_lru_gen_full.txt").write_text(full("6.1"))
    (HERE / "6.12_lru_gen_full.txt").write_text(full("6.12"))


if __name__ == "__main__":
    main()
