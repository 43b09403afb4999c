"""Compare two debug sessions and report the first pipeline stage where they diverge.

Adds: divergence hunting between two runs of the pi0 LIBERO path (e.g. stage 2 vs the RL runner on the
same init state): raw obs -> processed obs -> model inputs -> model outputs -> actions, with max abs diffs.

    python scripts/compare_debug_sessions.py outputs/eval/debug/task0_init0 outputs/rl/debug/task0_init0 --atol 1e-6

Exit code 0 when the sessions agree, 1 when they diverge. (Single process; no torchrun.)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pi0.evaluation.debug import compare_sessions, format_report


@dataclass
class Config:
    """CLI options."""

    session_a: str
    session_b: str
    atol: float = 1e-6


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; return 1 on divergence."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("session_a")
    p.add_argument("session_b")
    p.add_argument("--atol", type=float, default=1e-6)
    cfg = Config(**vars(p.parse_args(argv)))
    first, rows = compare_sessions(cfg.session_a, cfg.session_b, cfg.atol)
    print(format_report(first, rows))
    return 0 if first is None else 1


if __name__ == "__main__":
    sys.exit(main())
