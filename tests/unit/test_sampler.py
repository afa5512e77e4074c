"""The lab guest's sampler (toolkit/lab/sampler.py) against a fake /proc and /sys tree, and the
/proc/zoneinfo reader it uses (kernel/procfs.py). No kernel: tests/live/test_sampler.py runs it on
this host against /proc/vmstat read around it."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from moetrace.run.sampler import read_samples

ZONEINFO = """Node 0, zone      DMA
  per-node stats
      nr_inactive_file 84648
  pages free     3840
        boost    0
        min      22
        low      27
        high     32
        promo    37
        spanned  4095
        present  3998
        managed  3840
        cma      0
        protection: (0, 440, 440, 440, 440)
      nr_free_pages 3840
  pagesets
    cpu: 0
              count: 0
              high:  0
              batch: 1
  node_unreclaimable:  0
  start_pfn:           1
Node 0, zone    DMA32
  pages free     102130
        boost    0
        min      659
        low      823
        high     987
        spanned  126941
        present  126941
        managed  115021
        protection: (0, 0, 0, 0, 0)
  pagesets
    cpu: 0
              count: 7
              high:  2839
Node 0, zone   Normal
  pages free     0
        boost    0
        min      0
        low      0
        high     0
        spanned  0
        present  0
        managed  0
        protection: (0, 0, 0, 0, 0)
"""


def test_zoneinfo_parse_and_sums():
    from moetrace.kernel.procfs import parse_zoneinfo, watermark_sums

    z = parse_zoneinfo(ZONEINFO)
    assert [x["zone"] for x in z] == ["DMA", "DMA32", "Normal"]
    assert z[1]["high"] == 987 and z[1]["free"] == 102130 and "promo" not in z[1]  # the pagesets' high: skipped
    assert z[0]["protection"] == [0, 440, 440, 440, 440]
    assert watermark_sums(z) == {"sum_min_pages": 681, "sum_low_pages": 850, "sum_high_pages": 1019,
                                 "managed_pages": 118861}


def _fake_root(tmp_path: Path, lru_gen: bool) -> Path:
    root = tmp_path / "root"
    (root / "proc/sys/vm").mkdir(parents=True)
    vm = "nr_free_pages 100\npgscan_kswapd 5\npgsteal_kswapd 4\npageoutrun 2\nallocstall_dma32 1\nallocstall_normal 0\n"
    (root / "proc/vmstat").write_text(vm)
    (root / "proc/meminfo").write_text("MemTotal:  486854 kB\nMemFree:   5716 kB\nMemAvailable: 9 kB\n"
                                       "Buffers: 1 kB\nCached:   273684 kB\nSwapCached: 0 kB\n")
    (root / "proc/zoneinfo").write_text(ZONEINFO)
    (root / "proc/buddyinfo").write_text("Node 0, zone      DMA      0      0      1      0      0      0      0      0"
                                         "      1      1      3 \nNode 0, zone    DMA32    218    121     80     42"
                                         "     49     40     35     29     26     21    728 \n")
    (root / "proc/sys/vm/min_free_kbytes").write_text("2731\n")
    (root / "proc/sys/vm/watermark_scale_factor").write_text("10\n")
    dbg = root / "sys/kernel/debug"
    dbg.mkdir(parents=True)
    (root / "proc/mounts").write_text("none /sys/kernel/debug debugfs rw 0 0\n")
    if lru_gen:
        shutil.copy(Path(__file__).resolve().parents[1] / "data" / "lru_gen" / "6.12_lru_gen.txt", dbg / "lru_gen")
    return root


def test_the_sampler_on_a_fake_tree(tmp_path):
    from moetrace.lab.sampler import Sampler
    from moetrace.run.sampler import VMSTAT_COUNTERS

    root = _fake_root(tmp_path, lru_gen=True)
    with Sampler(tmp_path / "s", memfree_hz=40, vmstat_hz=20, lru_gen_hz=20, root=root):
        time.sleep(0.3)
    s = read_samples(tmp_path / "s")
    assert list(s.vmstat.columns) == ["t", *VMSTAT_COUNTERS, "allocstall_dma32", "allocstall_normal"]
    assert s.vmstat["pgscan_kswapd"].eq(5).all() and s.vmstat["pgrefill"].isna().all()
    assert s.vmstat["t"].is_monotonic_increasing and len(s.vmstat) >= 3
    assert s.memfree[["memfree_kb", "cached_kb"]].drop_duplicates().values.tolist() == [[5716, 273684]]
    # buddyinfo: DMA 4 (one order-2 block) + 256 + 512 + 3 x 1024; DMA32 218 + 121 x 2 + ... + 728 x 1024
    dma32 = sum(c << i for i, c in enumerate([218, 121, 80, 42, 49, 40, 35, 29, 26, 21, 728]))
    assert s.memfree["free_dma_pages"].eq(4 + 256 + 512 + 3072).all() and s.memfree["free_dma32_pages"].eq(dma32).all()
    first = s.lru_gen[s.lru_gen["t"] == s.lru_gen["t"].min()]
    assert first["memcg_path"].tolist() == ["/moe"] * 4 and first["seq"].tolist() == [5, 6, 7, 8]
    assert first["nr_file"].tolist() == [0, 42038, 34956, 18973]
    m = s.meta
    assert m["complete"] and m["streams"]["vmstat"]["samples"] == len(s.vmstat)
    assert m["streams"]["memfree"]["ticks"] >= 5 and m["vmstat_absent"][0] == "pgscan_direct"
    assert m["debugfs"]["mounted_by_sampler"] is False and m["cpu_s"] is not None
    assert s.zoneinfo["start"]["sum_high_pages"] == 1019 and s.zoneinfo["end"]["min_free_kbytes"] == 2731
    assert s.zoneinfo["start"]["watermark_boost_factor"] is None  # absent knob: null


def test_the_sampler_says_why_lru_gen_was_not_sampled(tmp_path):
    from moetrace.lab.sampler import Sampler

    root = _fake_root(tmp_path, lru_gen=False)
    with Sampler(tmp_path / "s", root=root):
        pass
    m = json.loads((tmp_path / "s" / "sampler.json").read_text())
    assert not (tmp_path / "s" / "lru_gen.csv").exists()
    assert m["streams"]["lru_gen"]["available"] is False and "MGLRU" in m["streams"]["lru_gen"]["why_not"]
    (root / "proc/mounts").write_text("")
    with Sampler(tmp_path / "s2", root=root, memfree_hz=0):
        pass
    m = json.loads((tmp_path / "s2" / "sampler.json").read_text())
    assert "debugfs" in m["streams"]["lru_gen"]["why_not"] and m["streams"]["memfree"]["why_not"].startswith("switched")
    assert read_samples(tmp_path / "s2").memfree is None


def test_a_bad_rate_is_a_usage_error(tmp_path):
    from moetrace.errors import UsageError
    from moetrace.lab.sampler import Sampler

    with pytest.raises(UsageError, match="vmstat_hz"):
        Sampler(tmp_path, vmstat_hz=-1)




def test_the_sampler_imports_no_table_library():
    """It runs in the lab guest beside the cell: pandas / numpy would cost the guest's memory and,
    under TCG, seconds of start-up."""
    import subprocess
    import sys

    code = ("import sys, moetrace.lab.sampler; "
            "print(sorted(m for m in ('pandas', 'numpy', 'pyarrow', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
