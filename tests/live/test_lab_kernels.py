"""`moetrace lab kernels` on the installed lab kernels (live tier: the set-up installs Debian's
6.1.0-47 and 6.12.95 kernels; without them this skips, or fails under MOETRACE_LIVE=1). The
oracle: what was measured by booting each (README.md, "Kernel lab") (MGLRU default, kprobes, the
signatures that changed between 6.1 and 6.12) and the running kernel's own /proc and /sys."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

K61, K612 = "6.1.0-47-amd64", "6.12.95+deb12-amd64"


def _need(release: str) -> None:
    if not Path(f"/boot/vmlinuz-{release}").is_file():
        why = f"lab kernel {release} not installed (bash scripts/lab-setup.sh; `make setup` runs it as root)"
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def facts():
    _need(K61)
    _need(K612)
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "lab", "kernels", "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return {k["release"]: k for k in json.loads(r.stdout)}


def test_the_running_kernel(facts):
    k = facts[platform.release()]
    assert k["running"] is True and k["mglru_built"] is False and k["kprobes"] is False  # measured here
    assert k["btf"] is Path("/sys/kernel/btf/vmlinux").exists()
    assert k["functions"]["evict_folios"] is None and k["functions"]["mlock_folio"]


def test_the_newest_debian_kernel_is_unpacked_for_the_lab_not_installed(facts):
    """The set-up's newest Debian kernel (sid's 7.2 when it was written): listed with its facts,
    read from the unpacked tree (its config and the BTF in its image), and not the host's: no
    package of it installed, nothing of it under /boot or /lib/modules, no headers."""
    from common.lab import newest_release

    rel = newest_release()
    k = facts[rel]
    assert k["running"] is False and k["image"].startswith("/var/lib/moetrace/lab/kernels/")
    assert k["mglru_built"] is True and k["kprobes"] is True and k["btf"] is True and k["headers"] == "none"
    assert k["functions"]["evict_folios"] and k["functions"]["workingset_eviction"]
    installed = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n"], capture_output=True,
                               text=True).stdout
    assert rel not in installed  # linux-image / -binary / -modules / -base of it: none installed
    assert not Path(f"/boot/vmlinuz-{rel}").exists() and not Path(f"/lib/modules/{rel}").exists()
    sources = " ".join(p.read_text() for p in Path("/etc/apt").rglob("*") if p.is_file() and
                       p.suffix in (".list", ".sources"))
    assert "sid" not in sources.split() and "trixie-backports" not in sources  # the host's apt never saw it


def test_debian_61_mglru_built_off_old_signatures(facts):
    k = facts[K61]
    assert (k["mglru_built"], k["mglru_default"], k["kprobes"], k["btf"], k["headers"]) == (True, "off", True, True,
                                                                                           "exact")
    f = k["functions"]
    assert "struct scan_control *sc" in f["try_to_inc_max_seq"] and "bool *need_swapping" in f["evict_folios"]
    assert f["should_run_aging"] and f["mlock_new_page"] and f["munlock_page"]
    assert f["inc_max_seq"] is None and f["walk_mm"] is None and f["mlock_new_folio"] is None


def test_debian_612_mglru_on_new_signatures(facts):
    k = facts[K612]
    assert (k["mglru_built"], k["mglru_default"], k["kprobes"], k["btf"], k["headers"]) == (True, "on", True, True,
                                                                                           "exact")
    f = k["functions"]
    assert f["try_to_inc_max_seq"] == ("bool try_to_inc_max_seq(struct lruvec *lruvec, long unsigned int seq, "
                                       "bool can_swap, bool force_scan)")
    assert f["evict_folios"] == "int evict_folios(struct lruvec *lruvec, struct scan_control *sc, int swappiness)"
    assert f["lru_gen_look_around"].startswith("bool ")
    assert f["should_run_aging"] is None and f["mlock_new_page"] is None
    assert f["mlock_new_folio"] and f["munlock_folio"]


TOP_LEVEL = [("folio", "mapping"), ("folio", "index"), ("folio", "memcg_data"), ("address_space", "host"),
             ("inode", "i_ino"), ("inode", "i_sb"), ("super_block", "s_dev"), ("mem_cgroup", "nodeinfo")]


@pytest.mark.parametrize("release", ["running", K61, K612])
def test_btf_offsets_of_the_eviction_records_agree_with_pahole(tmp_path, release):
    """moetrace's BTF reader (struct offsets for `lab kernels` and the function signatures) agrees
    with pahole (the kernel's own BTF tool, installed with the lab's headers) on the members the
    mglru probe's eviction records read (the probe itself reads them through CO-RE relocations)."""
    import re
    import shutil

    from moetrace.kernel import btf as B

    if shutil.which("pahole") is None:
        pytest.fail("pahole missing: the lab set-up installs it with linux-headers") if os.environ.get(
            "MOETRACE_LIVE") == "1" else pytest.skip("pahole missing")
    if release == "running":
        raw = Path("/sys/kernel/btf/vmlinux").read_bytes()
    else:
        _need(release)
        raw = B.btf_from_elf(B.vmlinux_from_image(Path(f"/boot/vmlinuz-{release}").read_bytes()))
    f = tmp_path / "btf"
    f.write_bytes(raw)
    b = B.Btf(raw)
    for st, member in TOP_LEVEL:
        out = subprocess.run(["pahole", "-F", "btf", "-C", st, str(f)], capture_output=True, text=True).stdout
        m = re.search(rf"[\s*]{member}(\[\d*\])?;\s*/\*\s*(\d+)", out)
        assert m, (st, member, out[:400])
        assert b.offset_of(st, member) == int(m.group(2)), (release, st, member)
