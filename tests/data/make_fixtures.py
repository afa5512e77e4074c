"""Regenerate the checked-in parser fixtures (deterministic). Run from the repo root:

    .venv/bin/python tests/data/make_fixtures.py
"""

import random
from pathlib import Path

HERE = Path(__file__).parent


def request_300(path: Path) -> None:
    """A 300-token request: 1 token from prefill, 299 accepted in decode.

    4 layers x 64 experts, k=8: 200 normal steps, 40 speculative accepts
    (80 tokens), 19 failed speculations with fallback passes (19 tokens).
    """
    rng = random.Random(300)
    kinds = ["normal"] * 200 + ["spec_accept"] * 40 + ["spec_fallback"] * 19
    rng.shuffle(kinds)
    lines = []
    for layer in range(4):  # prefill: batched positions, excluded by the parser
        lines.append('{"step": 0, "layer": %d, "phase": "prefill", "experts": [%s]}'
                     % (layer, ", ".join(map(str, rng.sample(range(64), 8)))))

    def rec(step, layer, width):
        ex = rng.sample(range(64), 8)
        if width == 16:
            ex += rng.sample(range(64), 8)
        return '{"step": %d, "layer": %d, "experts": [%s]}' % (step, layer, ", ".join(map(str, ex)))

    for i, kind in enumerate(kinds, start=1):
        if kind == "normal":
            lines += [rec(i, layer, 8) for layer in range(4)]
        elif kind == "spec_accept":
            lines += [rec(i, layer, 16) for layer in range(4)]
        else:
            lines += [rec(i, layer, 16) for layer in range(4)]
            lines += [rec(i, layer, 8) for layer in range(4)]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    request_300(HERE / "request_300.jsonl")
