"""Every JSON document of the run, cell, sweep and lab directories, declared once, key by key at
every level, with its schema (docs/run-directory.md documents each key; a test holds the two,
the writers' output and the golden directories to each other).

A document is a ``TypedDict`` (the writers build them a section at a time, so they stay dicts);
a nested object is a ``TypedDict`` of its own, and a free-form map (per-probe counters, /proc
files, a table's columns) is a ``dict[str, V]``: its keys are names, not declared ones, and a
``V`` that is a ``TypedDict`` is declared below each of them. ``Required`` keys are written by
every writer of every version; the readers (:mod:`moetrace.run.metadata`) refuse a document
without them, naming the file and the key. An ``Annotated[T, See("file")]`` is an object
documented in the section of another file (``cell.json``'s ``replay_summary`` is a
``replay.json``).

:func:`key_paths` walks a declaration into its dotted key paths (``*`` stands for a key of a
free-form map, ``[]`` for the objects of an array); :func:`undeclared` walks a document against
its declaration. Nothing here reads a file: this module imports nothing of moetrace.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, NotRequired, Required, TypedDict, Union

RUN_SCHEMA = "moetrace.run"
RUN_SCHEMA_VERSION = 1
CELL_SCHEMA = "moetrace.cell/1"
REPLAY_SCHEMA = "moetrace.replay/1"
SWEEP_SCHEMA = "moetrace.sweep/1"
JOB_SCHEMA = "moetrace.job/1"
LAB_SCHEMA = "moetrace.lab/1"
MATRIX_SCHEMA = "moetrace.matrix/1"
GUEST_SCHEMA = "moetrace.guest/1"
SAMPLER_SCHEMA = "moetrace.sampler/1"


@dataclass(frozen=True)
class See:
    """An object documented in the section of another file (``file``), not again here."""

    file: str


# -- shared pieces ---------------------------------------------------------------------------------

class Geometry(TypedDict, total=False):
    name: str
    n_layers: int
    n_experts: int
    k: int
    expert_bytes: int


class PlanIdentity(TypedDict, total=False):
    """The replay's plan (replay.json ``plan``; the manifest's ``plan`` is a copy)."""

    path: str
    file_bytes: int
    identity: str
    n_layers: int
    n_experts: int
    k: int
    expert_bytes: int
    iterations: int
    passes: int
    reads: int
    hint_source: str
    distinct_experts: int


class PhasePages(TypedDict, total=False):
    """One phase's page-cache counts from the epochs (``<phase>_unattributed``: no evicted_by)."""

    added_pages: int
    evicted_pages: int
    re_added_pages: int
    evicted_by: dict[str, int]  # evictor -> pages


class Totals(TypedDict, total=False):
    experts_added_pages: int
    experts_evicted_pages: int
    experts_re_added_pages: int
    experts_requested_pages: int | None
    experts_requested_bytes: int | None
    experts_hit_pages: int | None
    unattributed_added_pages: int
    unattributed_evicted_pages: int
    experts_evicted_by: dict[str, int]
    unattributed_evicted_by: dict[str, int]
    syscall_read_bytes_tracked_all_files: int | None
    experts_device_read_bytes: int | None
    unattributed_device_read_bytes: int | None
    # a model file as the pool: its shared and non-expert pages
    shared_added_pages: int
    shared_evicted_pages: int
    shared_re_added_pages: int
    non_expert_added_pages: int
    non_expert_evicted_pages: int
    non_expert_re_added_pages: int


class MglruState(TypedDict, total=False):
    """/sys/kernel/mm/lru_gen (moetrace.kernel.features.mglru_state)."""

    enabled_raw: str | None
    enabled_mask: int | None
    on: bool
    min_ttl_ms: int | None
    debugfs_lru_gen: bool


# -- manifest.json ---------------------------------------------------------------------------------

class ManifestPool(TypedDict, total=False):
    root: str
    identity: str | None
    layout: str
    geometry: Geometry
    extent_bytes: int
    pages_per_expert: int
    files: int
    s_dev: int
    s_dev_text: str
    source: str


class KernelFacts(TypedDict, total=False):
    release: str
    btf: bool


class Privileges(TypedDict, total=False):
    root: bool
    cap_bpf: bool
    cap_perfmon: bool
    cap_sys_admin: bool


class DamonRegion(TypedDict, total=False):
    start: int
    end: int


class DamonQuotas(TypedDict, total=False):
    bytes: int | None
    ms: int | None
    reset_interval_ms: int | None


class DamonFilter(TypedDict, total=False):
    type: str | None
    matching: bool
    allow: bool | None
    memcg_path: str | None
    addr_start: int | None
    addr_end: int | None
    min: int | None
    max: int | None
    layer: str


class DamonScheme(TypedDict, total=False):
    thread: str
    pid: int | None
    operations: str | None
    action: str | None
    regions: list[DamonRegion]
    min_idle_s: float | None
    quotas: DamonQuotas
    filters: list[DamonFilter]
    evicts_page_cache: bool
    effect: str


class BackgroundReclaimers(TypedDict, total=False):
    damon: list[DamonScheme]
    damon_available: bool


class AttachCandidate(TypedDict, total=False):
    kind: str
    target: str
    fn_name: str
    note: str
    fields: list[str]
    field_knobs: dict[str, str]  # tracepoint field -> the knob its presence sets
    sets: dict[str, int]  # knob -> value this candidate sets


class AttachTried(TypedDict, total=False):
    kind: str
    target: str
    reason: str


class AttachEntry(TypedDict, total=False):
    group: str
    required: bool
    status: str
    candidate: AttachCandidate | None
    reason: str
    checked: bool
    tried: list[AttachTried]


class Loader(TypedDict, total=False):
    backend: str
    object: str
    core_btf: str


class ProbeFailure(TypedDict, total=False):
    stage: str
    error: str


class ProbeAttach(TypedDict, total=False):
    """One probe's attach plan (moetrace.record.spec.AttachPlan.to_dict) and what came of it."""

    probe: str
    status: str
    reason: str
    blocked: str
    knobs: dict[str, int]
    entries: list[AttachEntry]
    recorded: bool
    skip_reason: str | None
    switched_off: dict[str, str]  # program -> why its knob left it off
    loader: Loader
    failed: ProbeFailure


class Clock(TypedDict, total=False):
    probes: str
    replay: str
    recorder: str


class Interval(TypedDict, total=False):
    armed_ns: int
    armed_done_ns: int
    disarm_start_ns: int
    disarmed_ns: int
    gated: dict[str, bool]  # probe -> counted only inside the interval
    note: str


class Requested(TypedDict, total=False):
    source: str
    available: bool


class EpochsInfo(TypedDict, total=False):
    mode: str | None
    slots: int
    epochs: int
    errors: list[str]
    source: str
    by_phase: dict[str, PhasePages] | None  # phase, and <phase>_unattributed


class ColumnDoc(TypedDict, total=False):
    dtype: str
    unit: str
    doc: str
    check: str  # how readers validate the column (n, i, s, b; ? optional)


class BlockDevice(TypedDict, total=False):
    disk: str
    tp_dev: int
    tp_dev_text: str
    partition: str | None
    part_start_sector: int
    extents: int


class BpfRuntime(TypedDict, total=False):
    stats_enabled: bool
    command_wall_ns: int
    per_probe_run_time_ns: dict[str, int] | None
    per_probe_runs: dict[str, int] | None
    total_run_time_ns: int | None
    cpu_fraction_of_wall: float | None
    programs: dict[str, dict[str, dict[str, Any]]] | None  # probe -> program -> its fdinfo counters
    note: str


class Detach(TypedDict, total=False):
    releaser_pid: int
    waited: bool
    note: str


class Manifest(TypedDict, total=False):
    """manifest.json. Per-probe sections are maps keyed by probe name; what a probe counts as
    lost, as stats and as its summary is its own (declared by the probe), free-form here."""

    schema: Required[str]
    schema_version: int
    toolkit_version: str
    command: list[str]
    record_command: list[str]
    created: str
    complete: bool
    exit_status: int | None
    interrupted_by: str | None
    command_signal: str
    child_pid: int
    plan: PlanIdentity | None
    pool: ManifestPool | None
    replay_dir: str
    replay_complete: bool | None
    cgroup: str | None
    kernel: KernelFacts
    mglru: MglruState | None
    privileges: Privileges
    background_reclaimers: BackgroundReclaimers
    probes: list[str]
    attach_plan: dict[str, ProbeAttach]
    knobs: dict[str, dict[str, int]]
    clock: Clock
    interval: Interval
    lost: dict[str, dict[str, Any]]
    stats: dict[str, dict[str, int]]
    summaries: dict[str, dict[str, Any]]
    timings: dict[str, float]  # <probe>_load_s, <probe>_attach_s, ... (keys named in the doc)
    requested: Requested | None
    totals: Totals
    epochs: EpochsInfo
    add_causes: dict[str, Any]  # pagecache: fault_tracepoint, note, folio_orders {cause: {order: add events}}
    kernel_maps: dict[str, dict[str, Any]]  # per probe: bytes, by_map (the maps the pool sizes)
    tables: dict[str, dict[str, ColumnDoc]]  # table -> column -> its declaration
    notes: list[str]
    failed_probes: dict[str, ProbeFailure]
    block_device: BlockDevice
    bpf_prog_ids: list[int]
    bpf_runtime: BpfRuntime
    detached: bool
    detach: Detach
    recorded: bool  # only in the manifest open_run(..., unrecorded=True) makes


# -- snapshots -------------------------------------------------------------------------------------

class ScopeCounters(TypedDict, total=False):
    path: str
    exists: bool
    usage_bytes: int | None
    peak_bytes: int | None
    oom_events: dict[str, int]
    stat: dict[str, int]
    pids: list[int]


class Snapshot(TypedDict, total=False):
    """One /proc snapshot (a cell's snapshots/<label>.json; a run's snapshots.json by label)."""

    label: Required[str]
    monotonic_ns: Required[int]
    realtime_ns: Required[int]
    diskstats: Required[dict[str, Any]]
    vmstat: Required[dict[str, int]]
    meminfo: Required[dict[str, int]]
    psi: Required[dict[str, dict[str, dict[str, float]]]]  # resource -> some|full -> avg10 ... total_us
    lru_gen: dict[str, Any] | None
    vmlck_bytes: dict[str, int | None]
    scope: ScopeCounters | None
    balloon_scope: ScopeCounters | None


class PoolDisk(TypedDict, total=False):
    disk: str
    pre: dict[str, int]  # /proc/diskstats fields of the disk
    post: dict[str, int]


class Snapshots(TypedDict, total=False):
    """snapshots.json of a run."""

    pre: Annotated[Snapshot, See("snapshots/<label>.json")]
    post: Annotated[Snapshot, See("snapshots/<label>.json")]
    pool_disk: PoolDisk


# -- replay.json -----------------------------------------------------------------------------------

class ReplayPool(TypedDict, total=False):
    root: str
    layout: str
    identity: str | None
    geometry: Geometry
    extent_bytes: int
    data_bytes: int
    files: int


class ReplayArena(TypedDict, total=False):
    requested_bytes: int | None
    experts: int
    bytes: int
    freq_table: str | None
    preload_method: str | None
    preload_bytes: int
    accesses_per_pass: int


class PhaseStats(TypedDict, total=False):
    repeats: int
    iterations: int
    duration_ns: int
    wall_ns: list[int]
    bytes: int
    reads: int
    arena_hits: int
    hints_submitted: int
    hints_overwritten: int
    hints_completed: int
    gbps: float | None


class MeasuredStats(TypedDict, total=False):
    iterations: int
    median_ns: float
    min_ns: int
    max_ns: int
    mean_ns: float
    p10_ns: float
    p90_ns: float
    spread_ns: int
    spread_rel: float | None
    per_iteration_ns: list[list[int]]


class Hints(TypedDict, total=False):
    kind: str
    submitted: int
    overwritten: int
    completed: int
    pending: int
    experts_issued: int
    hint_sets_per_pass: int
    error: str | None


class ReplayEpochs(TypedDict, total=False):
    mode: str
    slots: int
    error: str | None
    assigned: list[list[Any]]  # rows [epoch, phase, repeat, iteration, start_ns, folded]


class ReplaySummary(TypedDict, total=False):
    """replay.json (moetrace.replay.harness.summarize)."""

    schema: Required[str]
    toolkit_version: str
    command: list[str]
    complete: bool
    exit_status: int
    error: str | None
    clock: str
    pid: int
    plan: PlanIdentity
    pool: ReplayPool
    mode: str
    threads: int
    warmup: int
    passes: int
    duration_s: float | None
    read_bytes_per_call: int
    read_len_bytes: int
    prefetch: str
    fadvise_random: bool
    fd_mode: str
    arena: ReplayArena
    arena_experts: int
    arena_bytes: int
    vmlck_bytes: int | None
    preload_ns: int
    loop_entry_ns: int | None
    measured_start_ns: int | None
    measured_end_ns: int | None
    phases: dict[str, PhaseStats]  # warmup, measured
    measured: MeasuredStats
    hints: Hints | None
    epochs: ReplayEpochs | None
    interrupted_by: str | None


# -- cell.json -------------------------------------------------------------------------------------

class CellCommon(TypedDict, total=False):
    """The CellSpec fields a sweep's cells share (moetrace.capacity.cell.CellSpec)."""

    plan: str
    pool: str
    mechanism: str
    mode: str
    headroom_bytes: int
    threads: int
    warmup: int
    passes: int
    arena_fraction: float | None
    prefetch: str
    fadvise_random: bool
    freq_table: str | None
    timeout_s: float
    drop_caches: bool
    record: bool
    stream_events: bool
    watch: bool
    outside_evictions: str
    miss_curve: str | None
    duration_s: float | None
    record_probes: str | None
    balloon_thp: str | None


class CellInputs(CellCommon, total=False):
    """The cell's CellSpec (moetrace.capacity.cell.CellSpec), every field but replay_argv."""

    capacity_bytes: int
    name: str
    python: str


class HostFacts(TypedDict, total=False):
    name: str | None
    kernel: str | None
    mglru: str | None
    device: str | None
    model: str | None
    cpus: int | None
    memory_bytes: int | None


class CellScope(TypedDict, total=False):
    path: str
    cgroup_version: int
    limit_bytes: int | None


class CellDevice(TypedDict, total=False):
    name: str
    disk: str
    major: int
    minor: int


class CellPlan(TypedDict, total=False):
    n_iterations: int
    n_passes: int
    n_reads: int


class CellPool(TypedDict, total=False):
    root: str
    layout: str
    extent_bytes: int
    expert_bytes: int
    data_bytes: int


class TopUp(TypedDict, total=False):
    mem_available_bytes: int
    anon_bytes: int
    target_bytes: int
    reserve_bytes: int
    bytes: int
    pid: int
    vmlck_bytes: int
    verified: bool
    mem_available_after_bytes: int


class Balloon(TypedDict, total=False):
    mem_available_bytes: int
    mem_total_bytes: int
    reserve_bytes: int
    balloon_bytes: int
    scope: str
    recorder_allowance_bytes: int
    pid: int
    vmlck_bytes: int
    verified: bool
    top_up: TopUp
    released_at: str
    oom_events: dict[str, int]


class CellRecording(TypedDict, total=False):
    """cell.json ``record`` (``--record``) or ``watch`` (the pagecache-only recording)."""

    run_dir: str
    argv: list[str]
    replay_pid: int
    complete: bool | None
    epochs_mode: str | None
    measured_pages: Annotated[PhasePages | None, See("manifest.json")]  # its epochs.by_phase.measured
    warmup_pages: Annotated[PhasePages | None, See("manifest.json")]
    totals: Annotated[Totals | None, See("manifest.json")]
    lost: dict[str, dict[str, Any]] | None
    measured_re_added_pages_per_iteration: float
    measured_added_pages_per_iteration: float
    error: str


class LoopEntry(TypedDict, total=False):
    vmlck_bytes: int
    arena_bytes: int


class OutsideEvictions(TypedDict, total=False):
    pages: int | None
    by: dict[str, int] | None  # evictor -> pages
    own_mechanism: list[str]
    own_pages: dict[str, int]
    window: str
    policy: str
    why_na: str


class ShadowNodes(TypedDict, total=False):
    cell: int
    measured: int


class Simulated(TypedDict, total=False):
    budget_experts: int
    scored_accesses: int
    hits: int
    misses: int
    hit_rate: float | None
    scored_iterations: int
    miss_bytes_per_iteration: float


class CellKernel(TypedDict, total=False):
    release: str
    mglru: MglruState | None  # at the cell's start


class Cell(TypedDict, total=False):
    """cell.json (moetrace.capacity.cell.run_cell; a cell whose setup failed: the required keys)."""

    schema: Required[str]
    complete: Required[bool]
    inputs: CellInputs
    capacity_bytes: Required[int]
    mechanism: Required[str]
    mode: Required[str]
    headroom_bytes: int
    arena_request_bytes: int | None
    kernel: CellKernel
    host: HostFacts
    scope: CellScope
    device: CellDevice
    plan: CellPlan
    pool: CellPool
    balloon: Balloon
    retained: Required[bool]
    reasons: Required[list[str]]
    notes: list[str]
    flags: list[str]
    stale_scopes_removed: list[str]
    replay_argv: list[str]
    replay_pid: int
    replay_exit: int
    record: CellRecording
    watch: Annotated[CellRecording, See("cell.json")]  # the keys of `record`
    loop_entry: LoopEntry
    mem_available_at_loop_entry_bytes: int | None
    anon_at_loop_entry_bytes: int | None
    file_capacity_at_loop_entry_bytes: int
    scope_alive_at_end: bool
    peak_memory_bytes: int | None
    oom_events: dict[str, int]
    scope_removed: bool
    kernel_log: list[str]
    kernel_log_source: str
    outside_evictions: OutsideEvictions
    replay_summary: Annotated[ReplaySummary | None, See("replay.json")]
    measured_logical_bytes: int
    measured_arena_hits: int
    measured_hints_submitted: int
    measured_hints_overwritten: int
    measured_hints_completed: int
    iteration_time_median_ns: float | None
    iteration_time_min_ns: float | None
    iteration_time_max_ns: float | None
    iteration_time_spread: float | None
    measured_iterations: int
    device_bytes: int | None
    measured_interval_ns: int
    device_bytes_per_iteration: float | None
    vmstat_pgpgin_bytes: int
    refault_file_pages: int
    shadow_nodes_reclaimed: ShadowNodes
    memcg_pgpgin_pages: int
    vmlck_at_loop_entry_bytes: int | None
    vmlck_expected_bytes: int
    simulated: Simulated | None
    miss_bytes_per_iteration: float | None
    amplification: float | None


# -- the sweep: sweep.json, jobs/<name>.json, jobs/<name>.ran.json ---------------------------------

class SweepCellsSpec(CellCommon, total=False):
    """The cells' common CellSpec in sweep.json (absolute paths; every field but those that
    differ per cell: capacity_bytes, name, python), with the plan's content key."""

    replay_argv: list[str] | None
    plan_key: str


class SweepSpec(TypedDict, total=False):
    cells: SweepCellsSpec
    capacities: list[list[Any]]  # [label, bytes]
    repeats: int
    seed: int


class SweepCell(TypedDict, total=False):
    name: str
    capacity: str
    repeat: int
    order: int
    dir: str


class SweepMeta(TypedDict, total=False):
    """sweep.json."""

    schema: Required[str]
    digest: Required[str]
    spec: Required[SweepSpec]
    cells: Required[list[SweepCell]]


class JobSpec(CellInputs, total=False):
    replay_argv: list[str] | None


class Job(TypedDict, total=False):
    """jobs/<name>.json: a sweep's cell (kind sweep-cell) or a matrix's (kind matrix-cell)."""

    schema: Required[str]
    kind: str
    name: Required[str]
    out: Required[str]
    label: str
    repeat: int
    order: int
    curve: str | None
    stage_pool: str | None
    spec: JobSpec
    dir: str  # matrix-cell: the cell's directory under cells/


class Ran(TypedDict, total=False):
    """jobs/<name>.ran.json: the job's last attempt."""

    name: Required[str]
    host: str
    job_id: str
    started_at: float
    ended_at: float | None  # null while running
    outcome: str


class Attempt(TypedDict, total=False):
    """One line of jobs/attempts.jsonl."""

    name: str
    at: float
    event: str
    attempt: int
    job_id: str | None
    executor: str
    log: str
    error: str | None


# -- the lab: lab.json, a matrix cell's done.json --------------------------------------------------

class BootFailure(TypedDict, total=False):
    attempt: int
    cause: str
    console: str


class LabMemcg(TypedDict, total=False):
    path: str


class Lab(TypedDict, total=False):
    """lab.json (moetrace.lab.run.run_in_guest) with the guest's own status file merged in."""

    schema: Required[str]
    kernel: str
    image: str
    command: list[str]
    memory: str
    cpus: int
    kernel_cmdline: str
    mglru_requested: str
    accel: str
    accel_requested: str
    kvm_fallback: str | None
    tcg_thread: str | None
    swap_bytes: int | None
    status: str | None
    core_btf: str | None
    pool: str | None
    memcg: dict[str, str] | None  # path, memory.max
    host_wall_s: float
    qemu_returncode: int | None
    boot_failures: list[BootFailure]
    qemu_stderr: str
    console_tail: str
    # the guest's status file
    cmd_start_uptime_s: float
    exit_status: int
    release: str
    mglru: str
    end_uptime_s: float
    setup_error: str
    raw: str
    error: str


class LabSummary(TypedDict, total=False):
    """done.json ``lab``: lab.json's fields a matrix keeps (moetrace.lab.matrix.LAB_KEYS)."""

    status: str | None
    exit_status: int
    kernel: str
    release: str
    mglru: str
    mglru_requested: str
    accel: str
    tcg_thread: str | None
    cpus: int
    memory: str
    swap_bytes: int | None
    kernel_cmdline: str
    host_wall_s: float
    cmd_start_uptime_s: float
    end_uptime_s: float
    boot_failures: list[BootFailure]


# -- a matrix cell's guest: guest_settings.json (moetrace.lab.guest) -------------------------------

class GuestRequest(TypedDict, total=False):
    """What the matrix asked the guest wrapper for (moetrace.lab.matrix.guest_settings)."""

    capacity_bytes: int | None
    pool: str | None
    memcg: str | None
    min_free_kbytes: int | None
    bite_fraction: float | None
    read_ahead_kb: int | None
    min_ttl_ms: int | None
    swap: bool | None
    thp: str | None
    bites_bytes: int | None
    sampler: bool | None


class GuestKnob(TypedDict, total=False):
    path: str
    before: Any  # as it read before (THP: the bracketed mode)
    wanted: Any
    after: Any  # as it read back


class WatermarkState(TypedDict, total=False):
    min_free_kbytes: int
    watermark_scale_factor: int
    sum_min_pages: int
    sum_low_pages: int
    sum_high_pages: int
    managed_pages: int
    sum_boost_pages: int  # the zones' watermark_boost, counted in the three sums above
    bite_fraction: float | None  # sum_high_pages x page / C


class WatermarkAttempt(TypedDict, total=False):
    min_free_kbytes: int
    watermark_scale_factor: int
    predicted_sum_high_pages: int
    sum_high_pages: int  # /proc/zoneinfo's, read after the writes, its boost taken out


class GuestWatermarks(TypedDict, total=False):
    before: WatermarkState
    after: WatermarkState
    target_sum_high_pages: int
    attempts: list[WatermarkAttempt]
    reached: bool


class GuestSwap(TypedDict, total=False):
    device: str
    on: bool
    swaps: list[str]  # /proc/swaps' lines after swapon
    off_at_end: bool | None


class GuestSampler(TypedDict, total=False):
    dir: str
    running: bool
    note: str | None


class GuestController(TypedDict, total=False):
    """moetrace.lab.bites_controller.BitesController.summary, after it stopped."""

    csv: str
    pages: int
    memcg_path: str | None
    threshold_kb: int
    interval_s: float
    t0_monotonic_ns: int
    wall_s: float | None
    poll_hz: float | None
    bites: int
    rounds: int
    agings: int
    steal_pages: int
    errors: int
    polls: int
    skipped: int  # polls below the threshold while the memcg held no file pages
    error: str | None


class GuestSettings(TypedDict, total=False):
    """guest_settings.json: what the wrapper applied and started around a matrix cell."""

    schema: Required[str]
    request: Required[GuestRequest]
    cell_argv: list[str]
    pid: int  # the wrapper's (the controller's thread is in it: the vmscan probe's tgid of its evictions)
    knobs: dict[str, GuestKnob]  # thp, min_ttl_ms, read_ahead_kb, min_free_kbytes, watermark_scale_factor
    restored: list[str]
    watermarks: GuestWatermarks
    swap: GuestSwap
    sampler: GuestSampler
    controller: GuestController
    errors: Required[list[str]]
    notes: list[str]
    exit_status: int | None
    started_monotonic_ns: int
    ended_monotonic_ns: int


class MatrixCellDoc(TypedDict, total=False):
    """moetrace.lab.matrix.MatrixCell.as_dict."""

    kernel: str
    mglru: str
    mechanism: str
    capacity_label: str
    capacity_bytes: int
    repeat: int
    order: int
    condition: str
    name: str
    dir: str
    settings: dict[str, Any]  # the cell's values of the spec's dimensions (moetrace.lab.dims)
    dims: str  # the part of its name of the dimensions that vary


class MatrixSpecDoc(TypedDict, total=False):
    """moetrace.lab.matrix.MatrixSpec.canonical: the spec as resolved."""

    kernels: list[str]
    mglru: list[str]
    mechanisms: list[str]
    capacities: list[list[Any]]  # [label, bytes]
    plan: str
    pool: str
    repeats: int
    mode: str
    seed: int
    headroom: int
    warmup: int
    passes: int
    threads: int
    guest_base: int
    cgroup_guest_memory: int
    balloon_reserve: int
    timeout: float
    kernel_modules: dict[str, str]  # kernel -> its modules_install directory
    # the dimensions (moetrace.lab.dims), only when given: their values
    cpus: list[int]
    readers: list[int]
    min_free_kbytes: list[int]
    bite_fraction: list[float]
    window: list[Any]  # passes (int) or a time ("480s")
    pool_layout: list[str]
    read_ahead_kb: list[int]
    min_ttl_ms: list[int]
    swap: list[int]  # bytes, 0: none
    thp: list[str]
    tcg_thread: str
    stream_events: bool  # only when true


class MatrixMeta(TypedDict, total=False):
    """matrix.json."""

    schema: Required[str]
    digest: Required[str]
    spec: Required[MatrixSpecDoc]
    spec_file: str | None
    cells: Required[list[MatrixCellDoc]]


class MatrixRow(TypedDict, total=False):
    """A matrix cell's done.json (a row of the matrix): the cell, what its guest said, its
    outcome and its cell.json."""

    cell: Required[MatrixCellDoc]
    lab: Required[LabSummary]  # {} when the job gave up before a guest ran
    retained: Required[bool]
    reasons: Required[list[str]]
    result: Required[Annotated[Cell | None, See("cell.json")]]
    guest: Annotated[GuestSettings, See("guest_settings.json")]  # the wrapper's, when it ran


# -- the lab guest's sampler: sampler/sampler.json, sampler/zoneinfo.json ----------------------------

class SamplerStream(TypedDict, total=False):
    """One sampled file: what was asked and what was taken."""

    file: str  # the CSV written
    source: str | None  # the kernel file read (null: none was found)
    requested_hz: float
    samples: int  # rows: one at the start, one per tick taken, one at the end
    ticks: int  # samples taken on the grid of 1 / requested_hz
    achieved_hz: float | None  # ticks / wall time (null: no wall time)
    missed_ticks: int  # ticks skipped because a read ran late
    read_s_mean: float | None  # mean seconds per read and parse
    available: bool
    why_not: str | None


class SamplerDebugfs(TypedDict, total=False):
    path: str | None
    mounted_by_sampler: bool
    note: str | None
    unmount_note: str | None


class SamplerMeta(TypedDict, total=False):
    """sampler.json (moetrace.lab.sampler.Sampler): what ran, the rates achieved, what failed."""

    schema: Required[str]
    t0_monotonic_ns: Required[int]  # t = 0 of every CSV (CLOCK_MONOTONIC, the probes' clock)
    end_monotonic_ns: int | None
    wall_s: float | None
    complete: bool
    kernel_release: str
    streams: Required[dict[str, SamplerStream]]
    vmstat_columns: list[str]
    vmstat_absent: list[str]
    debugfs: SamplerDebugfs
    cpu_s: float | None  # the sampling thread's CPU time
    cpu_share: float | None  # cpu_s / wall_s
    errors: list[str]
    command: list[str]
    exit_status: int | None


class ZoneDoc(TypedDict, total=False):
    """One zone of /proc/zoneinfo (pages)."""

    node: int
    zone: str
    managed: int
    present: int
    spanned: int
    free: int
    min: int
    low: int
    high: int
    boost: int
    promo: int
    cma: int
    protection: list[int]


class ZoneinfoSide(TypedDict, total=False):
    """The watermarks and the knobs that size them, read once (at the start or the end)."""

    monotonic_ns: int
    zones: list[ZoneDoc]
    sum_min_pages: int
    sum_low_pages: int
    sum_high_pages: int
    managed_pages: int
    min_free_kbytes: int | None
    watermark_scale_factor: int | None
    watermark_boost_factor: int | None
    page_size_bytes: int
    mem_total_bytes: int | None
    lru_gen_enabled: str | None
    min_ttl_ms: int | None
    transparent_hugepage: str | None


class ZoneinfoDoc(TypedDict, total=False):
    """sampler/zoneinfo.json: the zones at the start and at the end of the sampling."""

    schema: Required[str]
    start: Required[ZoneinfoSide]
    end: ZoneinfoSide | None


# -- the walk --------------------------------------------------------------------------------------

#: file (as docs/run-directory.md names its section) -> its declaration
DOCUMENTS: dict[str, type] = {
    "manifest.json": Manifest, "snapshots.json": Snapshots, "snapshots/<label>.json": Snapshot,
    "guest_settings.json": GuestSettings,
    "replay.json": ReplaySummary, "cell.json": Cell, "sweep.json": SweepMeta, "jobs/<C>-r<i>.json": Job,
    "jobs/<C>-r<i>.ran.json": Ran, "jobs/attempts.jsonl": Attempt, "lab.json": Lab, "matrix.json": MatrixMeta,
    "done.json": MatrixRow, "sampler.json": SamplerMeta, "zoneinfo.json": ZoneinfoDoc,
}

#: keys moetrace wrote before and no longer writes: accepted in older directories (the golden
#: ones), not documented (dotted paths as key_paths gives them)
RETIRED: dict[str, frozenset[str]] = {
    "cell.json": frozenset({"inputs.kernel"}),
    "manifest.json": frozenset({"kernel.headers", "kernel.headers_detail", "attach_plan.*.needs",
                                "attach_plan.*.headers", "attach_plan.*.entries[].candidate.needs",
                                "attach_plan.*.compiled_out"}),  # read as switched_off (directory.RENAMED_KEYS)
}


def is_declaration(t: Any) -> bool:
    """A TypedDict (a declared object)."""
    return isinstance(t, type) and issubclass(t, dict) and hasattr(t, "__annotations__") \
        and hasattr(t, "__total__")


def unwrap(t: Any) -> tuple[Any, See | None]:
    """The type without None, Required/NotRequired and Annotated; the See of an Annotated."""
    see = None
    while True:
        origin = typing.get_origin(t)
        if origin is Annotated:
            see = next((m for m in t.__metadata__ if isinstance(m, See)), see)
            t = t.__origin__
        elif origin in (Required, NotRequired):
            t = typing.get_args(t)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(t) if a is not type(None)]
            if len(args) != 1:
                return t, see
            t = args[0]
        else:
            return t, see


def fields(td: type) -> dict[str, Any]:
    """A TypedDict's keys and their (resolved) types, inherited ones included."""
    return typing.get_type_hints(td, include_extras=True)


def key_paths(td: type, prefix: str = "", follow_see: bool = False) -> dict[str, Any]:
    """Every dotted key path of the declaration ``td`` -> its type (``*``: a key of a free-form
    map, ``[]``: the objects of an array). An object documented in another file's section
    (``See``) is a leaf unless ``follow_see``."""
    out: dict[str, Any] = {}
    for k, t in fields(td).items():
        path = f"{prefix}{k}"
        out[path] = t
        _below(t, path, out, follow_see)
    return out


def _below(t: Any, path: str, out: dict[str, Any], follow_see: bool) -> None:
    t, see = unwrap(t)
    if see is not None and not follow_see:
        return
    if is_declaration(t):
        out.update(key_paths(t, path + ".", follow_see))
        return
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is dict:
        out[path + ".*"] = args[1]
        _below(args[1], path + ".*", out, follow_see)
    elif origin is list and args:
        inner, _ = unwrap(args[0])
        if is_declaration(inner) or typing.get_origin(inner) is dict:
            _below(args[0], path + "[]", out, follow_see)


def undeclared(doc: Any, td: Any, prefix: str = "") -> list[str]:
    """The key paths of the document ``doc`` that its declaration ``td`` does not declare
    (free-form maps accept any key; ``Any`` anything below)."""
    t, _ = unwrap(td)
    if is_declaration(t):
        if not isinstance(doc, dict):
            return []
        decl = fields(t)
        out: list[str] = []
        for k, v in doc.items():
            path = f"{prefix}{k}"
            if k not in decl:
                out.append(path)
            else:
                out += undeclared(v, decl[k], path + ".")
        return out
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is dict and isinstance(doc, dict):
        return [p for v in doc.values() for p in undeclared(v, args[1], prefix + "*.")]
    if origin is list and args and isinstance(doc, list):
        return [p for v in doc for p in undeclared(v, args[0], prefix.rstrip(".") + "[].")]
    return []


def required_keys(td: type) -> frozenset[str]:
    """The keys of ``td`` every writer writes (``Required``, or not ``NotRequired`` in a total one).
    (``__required_keys__`` misses them here: the annotations are strings when the class is made.)"""
    out = set()
    for k, t in typing.get_type_hints(td, include_extras=True).items():
        while typing.get_origin(t) is Annotated:
            t = t.__origin__
        origin = typing.get_origin(t)
        if origin is Required or (origin is not NotRequired and td.__total__):
            out.add(k)
    return frozenset(out)


def missing_required(doc: Any, td: type, prefix: str = "") -> list[str]:
    """The Required keys of ``td`` (at every level of ``doc``'s objects) that ``doc`` lacks."""
    if not isinstance(doc, dict):
        return []
    out = [f"{prefix}{k}" for k in sorted(required_keys(td)) if k not in doc]
    for k, t in fields(td).items():
        inner, _ = unwrap(t)
        if k in doc and is_declaration(inner):
            out += missing_required(doc[k], inner, f"{prefix}{k}.")
    return out
