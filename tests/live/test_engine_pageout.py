"""Live: emptying a model from the page cache while an unmodified process keeps it mapped
(engines/pageout.py): process_madvise(MADV_PAGEOUT) on its mappings, then FADV_DONTNEED.
Oracle: mincore before and after (moetrace's own mapping only for the count). First a plain
process mapping the file shared and touching every page; then llama.cpp's server loading the
tiny MoE with mmap (its populate and WILLNEED make the whole file resident)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from common.engines import engine, free_port, serving  # noqa: F401  (engine: the fixture)
from moetrace.engines.pageout import empty_cache, file_mappings
from moetrace.kernel.syscalls import resident_pages

CHILD = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
s = sum(m[i] for i in range(0, len(m), 4096))
print("mapped", flush=True)
sys.stdin.read()
"""


def test_a_mapped_file_leaves_the_cache_and_the_process_keeps_running(live, tmp_path):
    f = tmp_path / "model.bin"
    with open(f, "wb") as fh:
        fh.write(os.urandom(8 << 20))
        os.fsync(fh.fileno())  # clean pages: fadvise could drop them, were they not mapped
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(f)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "mapped"
        assert resident_pages(f) == 2048 and len(file_mappings(p.pid, f)) == 1
        # fadvise alone leaves what the process maps
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert resident_pages(f) == 2048
        r = empty_cache(p.pid, f)
        assert r == {"resident_before_pages": 2048, "resident_after_pages": 0, "advised_bytes": 8 << 20, "rounds": 1}
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_llama_servers_model_leaves_the_cache_while_it_serves(live, engine, tmp_path):
    from moetrace.inputs.modelsynth import ModelSpec, synth_model

    e = engine
    m = tmp_path / "tiny.gguf"
    synth_model(m, ModelSpec(layers=2, experts=8, k=2, n_embd=64, n_ff_exp=128, head_dim=16))
    pages = -(-m.stat().st_size // 4096)
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    p = subprocess.Popen(e.command("llama-server", "-m", str(m), "-lm", "mmap", "--port", str(port), "-t", "1"),
                         env=e.env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        t_end = time.monotonic() + 60
        while not serving(port):  # the model loaded (populated, WILLNEED) and the server up
            assert p.poll() is None and time.monotonic() < t_end, (tmp_path / "server.log").read_text()[-2000:]
            time.sleep(0.2)
        assert file_mappings(p.pid, m)
        r = empty_cache(p.pid, m)
        # all of it resident after the load, less what DAMON may have taken meanwhile (it evicts
        # on this machine's schedule, not the test's)
        assert pages // 2 < r["resident_before_pages"] <= pages and r["resident_after_pages"] == 0, r
        assert p.poll() is None and serving(port)
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
