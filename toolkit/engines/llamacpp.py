"""llama.cpp as the set-up unpacked it: ``$MOETRACE_ENGINE_ROOT/llama.cpp/current/engine.json``
(default root /var/lib/moetrace/engines; scripts/engine-setup.sh writes it) names sid's loader,
the library path and the CPU backend ggml scored best on this machine. :meth:`Engine.command`
turns a tool and its arguments into the command line that runs it through that loader, and
:meth:`Engine.env` the environment it needs; :func:`find_engine` reads the set-up's record.

A process started this way is ``ld-linux-x86-64`` in /proc/PID/comm and exe: find it by pid.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrace.errors import InputError, MoetraceError

DEFAULT_ROOT = "/var/lib/moetrace/engines"
SETUP = "bash scripts/engine-setup.sh"
#: the routing logger's CPU backend variants directory (toolkit/engines/route_log.c)
BACKENDS_ENV = "MOETRACE_GGML_BACKENDS"


def engine_root() -> Path:
    return Path(os.environ.get("MOETRACE_ENGINE_ROOT") or DEFAULT_ROOT)


@dataclass(frozen=True)
class Engine:
    """One unpacked llama.cpp (engine.json's fields)."""

    path: Path  # the version's directory
    version: str  # Debian's, e.g. 1:0.7.0+dfsg-2
    build: str  # the tools' own --version line
    root: Path  # the unpacked packages
    loader: Path
    library_path: tuple[str, ...]
    backend: str | None  # GGML_BACKEND_PATH: a file
    packages: dict[str, str]
    cpu: str | None = None

    def tool(self, name: str) -> Path:
        """An unpacked tool (llama-cli, llama-simple, ...); MoetraceError naming the ones there are."""
        p = self.root / "usr" / "bin" / name
        if not p.is_file():
            have = sorted(x.name for x in (self.root / "usr" / "bin").glob("llama-*"))
            raise MoetraceError(f"llama.cpp {self.version} has no {name}", hint=f"one of: {', '.join(have)}")
        return p

    def command(self, tool: str, *args: str) -> list[str]:
        """The argv that runs the unpacked ``tool`` (:meth:`argv`)."""
        return self.argv(self.tool(tool), *args)

    def argv(self, program: str | os.PathLike, *args: str) -> list[str]:
        """The argv that runs ``program`` with sid's loader and libraries (the host's ld.so.cache
        never consulted, so no bookworm library stands in for a missing one)."""
        return [str(self.loader), "--inhibit-cache", "--library-path", ":".join(self.library_path), str(program),
                *args]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with GGML_BACKEND_PATH set (the backend
        the set-up chose for its CPU: llama.cpp's tools load it) and MOETRACE_GGML_BACKENDS, the
        directory of the CPU backend variants: the routing logger lets ggml score them on the CPU
        it runs on, so it runs in a lab guest too (QEMU's TCG CPU has no AVX-512 or AVX2)."""
        env = dict(os.environ if base is None else base)
        if self.backend:
            env["GGML_BACKEND_PATH"] = self.backend
            env[BACKENDS_ENV] = str(Path(self.backend).parent)
        return env

    @property
    def route_log(self) -> Path:
        """The routing logger the set-up built against this engine (toolkit/engines/route_log.c)."""
        return self.path / "bin" / "moetrace-route-log"

    def describe(self) -> dict[str, Any]:
        return {"engine": "llama.cpp", "version": self.version, "build": self.build, "path": str(self.path),
                "backend": self.backend, "cpu": self.cpu}


def read_engine(path: str | os.PathLike) -> Engine:
    """The engine recorded in ``path``/engine.json; InputError when it is damaged or gone."""
    d = Path(path).resolve()  # current -> the version's directory
    f = d / "engine.json"
    try:
        doc = json.loads(f.read_text())
        e = Engine(path=d, version=str(doc["version"]), build=str(doc.get("build") or ""),
                   root=Path(doc["root"]), loader=Path(doc["loader"]),
                   library_path=tuple(str(x) for x in doc["library_path"]), backend=doc.get("backend"),
                   packages={str(k): str(v) for k, v in (doc.get("packages") or {}).items()}, cpu=doc.get("cpu"))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"not a usable engine record: {err}", path=str(f), hint=f"run {SETUP} again") from None
    if not e.loader.is_file():
        raise InputError(f"its loader {e.loader} is gone", path=str(f), hint=f"run {SETUP} again")
    return e


def find_engine() -> Engine | None:
    """The set-up's current llama.cpp, or None when there is none (InputError: damaged)."""
    cur = engine_root() / "llama.cpp" / "current"
    return read_engine(cur) if (cur / "engine.json").is_file() else None


def require_engine() -> Engine:
    """find_engine, or a MoetraceError that says how to get one."""
    e = find_engine()
    if e is None:
        raise MoetraceError(f"no llama.cpp under {engine_root()}",
                            hint=f"run `{SETUP}` as root (Debian sid's packages, unpacked, ~20 s), or set "
                                 "MOETRACE_ENGINE_ROOT to where it put them")
    return e


LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")


ADVICE = ("normal", "random", "sequential")


def route_command(e: Engine, model: str | os.PathLike, out: str | os.PathLike, tokens: int = 64,
                  prompt: str = "the a b", load_mode: str = "mmap", threads: int = 1, repack: bool = True,
                  request: str = "r0", advise: str | None = None, step_fds: tuple[int, int] | None = None) -> list[str]:
    """The argv of the routing logger: ``tokens`` generated greedily from ``prompt``, each
    decode's routing written to ``out`` as router-trace JSON Lines. ``advise``: madvise the
    model's mappings after the load (ADVICE); ``step_fds``: (ready, go) pipe ends of a driver
    that runs between passes (:func:`log_routing`)."""
    if not e.route_log.is_file():
        raise MoetraceError(f"llama.cpp {e.version} has no routing logger ({e.route_log})",
                            hint=f"run `{SETUP}` again: it builds it (needs a C compiler)")
    if load_mode not in LOAD_MODES:
        raise MoetraceError(f"load mode {load_mode!r} is not one of {', '.join(LOAD_MODES)}")
    if advise is not None and advise not in ADVICE:
        raise MoetraceError(f"advice {advise!r} is not one of {', '.join(ADVICE)}")
    return e.argv(e.route_log, "-m", str(model), "-o", str(out), "-n", str(tokens), "-p", prompt, "-l", load_mode,
                  "-t", str(threads), "-r", request, *([] if repack else ["--no-repack"]),
                  *(["--advise", advise] if advise else []),
                  *(["--step", f"{step_fds[0]},{step_fds[1]}"] if step_fds else []))


def log_routing(model: str | os.PathLike, out: str | os.PathLike, cold: bool = False, cgroup: str | None = None,
                warmup_tokens: int = 0, **kw: Any) -> dict[str, Any]:
    """Run the routing logger (route_command's options) to completion; its summary (tokens,
    prompt_tokens, eval_ms, n_eval, layers, load_mode). MoetraceError with the logger's words
    when it fails; ``out`` is then removed.

    Under ``moetrace record`` (the pagecache probe's epoch map inherited) every pass is an epoch
    of its own (load, prefill, then per token: phase warmup for the first ``warmup_tokens``, then
    measured, iteration = the token: the run's expert_epochs are per token) and replay.json in
    MOETRACE_RUN_DIR says which; ``cold``: the model's pages are dropped from the
    page cache before every pass (:func:`moetrace.engines.pageout.empty_cache`), so each token
    reads what it routes. ``cgroup``: a cgroup directory the logger joins before the model loads
    (this process stays out: a cell's wall holds the engine alone)."""
    import subprocess
    import tempfile

    from moetrace.replay.epochs import EpochWriter

    e = require_engine()
    epochs = EpochWriter.from_env()
    with tempfile.TemporaryFile() as err_f:
        if cold or epochs is not None or cgroup is not None:
            rc, emptied = _stepped(e, model, out, cold, epochs, err_f, kw, cgroup, warmup_tokens)
        else:
            rc, emptied = subprocess.run(route_command(e, model, out, **kw), env=e.env(), stderr=err_f).returncode, []
        err_f.seek(0)
        err = err_f.read().decode(errors="replace").strip()
    last = err.splitlines()[-1] if err else ""
    if rc != 0 or not last.startswith("{"):
        Path(out).unlink(missing_ok=True)
        raise MoetraceError(f"the routing logger failed (exit {rc}): {err[-600:] or 'no message'}",
                            hint="is MODEL a llama.cpp model? `moetrace pool map MODEL` reads it")
    summary = json.loads(last)
    if cold:
        summary["cold"] = {"passes": len(emptied), "resident_after_pages_max": max(
            (x["resident_after_pages"] for x in emptied), default=0)}
    return summary


def _stepped(e: Engine, model, out, cold: bool, epochs, err_f, kw: dict, cgroup: str | None = None,
             warmup_tokens: int = 0) -> tuple[int, list[dict]]:
    """The logger with a driver before its load (into ``cgroup``) and between its passes
    (route_log.c --step): the cache emptied (``cold``), the epoch moved; (exit status, what
    each emptying found)."""
    import subprocess

    from moetrace.engines.pageout import empty_cache

    r_ready, w_ready = os.pipe()
    r_go, w_go = os.pipe()
    emptied: list[dict] = []
    if epochs is not None:
        epochs.begin_steps()
    try:
        p = subprocess.Popen(route_command(e, model, out, step_fds=(w_ready, r_go), **kw), env=e.env(),
                             stderr=err_f, pass_fds=(w_ready, r_go))
    finally:
        os.close(w_ready)
        os.close(r_go)
    try:
        with os.fdopen(r_ready, "rb") as ready:
            for line in ready:
                word = line.split()
                if word == [b"load"]:
                    if cgroup is not None:
                        Path(cgroup, "cgroup.procs").write_text(f"{p.pid}\n")
                    if epochs is not None:
                        epochs.step("load", None)
                    os.write(w_go, b"g")
                    continue
                if not word or word[0] != b"pass":
                    break
                n = int(word[1])
                if cold:
                    emptied.append(empty_cache(p.pid, model))
                if epochs is not None:
                    epochs.step("prefill" if n == 0 else "warmup" if n - 1 < warmup_tokens else "measured",
                                None if n == 0 else n - 1)
                os.write(w_go, b"g")
        rc = p.wait()
    except BaseException:
        p.kill()
        p.wait()
        raise
    finally:
        os.close(w_go)
    if epochs is not None:
        epochs.done()
        _write_epochs(epochs, p.pid, rc)
        epochs.close()
    return rc, emptied


def _write_epochs(epochs, pid: int, rc: int) -> None:
    """replay.json in the recorder's MOETRACE_RUN_DIR: which epoch was which pass."""
    import sys

    from moetrace.jsonutil import write_json
    from moetrace.run.replaylog import RUN_DIR_ENV
    from moetrace.run.documents import REPLAY_SCHEMA

    d = os.environ.get(RUN_DIR_ENV)
    if d:
        write_json(Path(d) / "replay.json", {"schema": REPLAY_SCHEMA, "command": sys.argv, "complete": rc == 0,
                                             "exit_status": rc, "pid": pid, "mode": "engine",
                                             "epochs": epochs.summary()})