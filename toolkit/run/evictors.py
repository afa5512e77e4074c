"""Who deleted a pool page: the evictor classes of the run tables' ``evicted_by_<class>_pages``
columns and of page_events' ``evictor`` (probes/moetrace.bpf.h EVICTOR_*, in slot order). Kept with
the run directory's vocabulary so that analyses read it without importing the recorder."""

#: who deleted a pool page: probes/moetrace.bpf.h EVICTOR_*, in slot order
EVICTORS = ("kswapd", "direct", "memcg", "proactive", "damon", "fadvise", "truncate", "drop_caches", "other")
EVICTOR_DOCS = {
    "kswapd": "the kswapd kernel thread (global background reclaim)",
    "direct": "direct reclaim in an allocating task (global)",
    "memcg": "memcg limit / high reclaim in a charging task",
    "proactive": "memory.reclaim (memcg reclaim inside a write(2) of <= 64 bytes) or madvise(MADV_PAGEOUT)",
    "damon": "a kdamond thread (DAMOS pageout, DAMON_RECLAIM)",
    "fadvise": "fadvise64(2) of any process (POSIX_FADV_DONTNEED)",
    "truncate": "truncate, ftruncate, fallocate, unlink, unlinkat",
    "drop_caches": "a write(2) outside reclaim: drop_caches (or an O_DIRECT write invalidating cached pages)",
    "other": "any other context (inode eviction at the last close, umount, migration, ...)",
}
