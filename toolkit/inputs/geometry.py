"""Model geometries: routed layers, experts per layer, k, expert bytes."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from moetrace.errors import UsageError


@dataclass(frozen=True)
class Geometry:
    """The shape of an expert pool. expert_id = layer * n_experts + expert."""

    n_layers: int
    n_experts: int
    k: int
    expert_bytes: int = 0
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.n_layers <= 0 or self.n_experts <= 0 or self.k <= 0:
            raise UsageError(f"geometry needs positive layers/experts/k, got {self}")
        if self.k > self.n_experts:
            raise UsageError(f"k={self.k} exceeds experts per layer={self.n_experts}")
        if self.expert_bytes < 0:
            raise UsageError("expert_bytes must be >= 0")

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_experts

    @property
    def pool_bytes(self) -> int:
        return self.n_total * self.expert_bytes

    def to_dict(self) -> dict:
        return asdict(self)


# Expert sizes: Kimi from the paper (1.45 TB / 82,432 experts, int4); the others
# are bf16 sizes of the three FFN matrices (hidden x intermediate x 3 x 2 bytes),
# or the pool size the paper gives (Qwen3-30B-A3B: 17.6 GB / 6,144 experts).
PRESETS: dict[str, Geometry] = {
    "kimi-k3": Geometry(92, 896, 16, 17_550_000, "kimi-k3"),
    "deepseek-v3": Geometry(58, 256, 8, 44_040_192, "deepseek-v3"),
    "qwen3-30b-a3b": Geometry(48, 128, 8, 2_864_583, "qwen3-30b-a3b"),
    "olmoe": Geometry(16, 64, 8, 12_582_912, "olmoe"),
}


def preset(name: str) -> Geometry:
    """Look up a geometry preset by name (kimi-k3, deepseek-v3, qwen3-30b-a3b, olmoe)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(
            f"unknown geometry preset {name!r}", hint=f"choose one of {', '.join(PRESETS)}"
        ) from None


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """Parse '256KiB', '17.55MB', '4096' into bytes (decimal and binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"cannot read a size from {text!r}", hint="write e.g. 4096, 256KiB, 17.55MB, 2GiB")
    return int(round(float(m.group(1)) * _UNITS[m.group(2).lower()]))


def format_bytes(n: float) -> str:
    """Human-readable binary size, three significant digits at most, no trailing zeros:
    '256 MiB', '97.4 MiB', '1.5 GiB', '4.6 KiB', '512 B'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1000 or unit == "TiB":
            break
        n /= 1024
    if unit == "B" or abs(n) >= 100:
        return f"{n:.0f} {unit}"
    text = f"{n:.{2 if abs(n) < 10 else 1}f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


_SECONDS = {"": 1.0, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | int | float) -> float:
    """Parse '8min', '90s', '1.5h', '30' (seconds) into seconds > 0."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        secs = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _SECONDS:
            raise UsageError(f"cannot read a duration from {text!r}", hint="write e.g. 90s, 8min, 1.5h or seconds")
        secs = float(m.group(1)) * _SECONDS[m.group(2).lower()]
    if not secs > 0:
        raise UsageError(f"a duration must be > 0, not {text!r}")
    return secs


def format_duration(seconds: float) -> str:
    """'8min' for whole minutes, else seconds ('90s', '2.5s'): a label for names and tables."""
    if seconds >= 60 and float(seconds / 60).is_integer():
        return f"{seconds / 60:g}min"
    return f"{seconds:g}s"
