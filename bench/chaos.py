"""Soak version of the invariant run (tests/chaos.py): as long as you like, then the same checks.

    python3 -m bench.chaos --seconds 600 --seed 3

Prints the report and exits 1 if any invariant was broken (a slot, connection, task, descriptor
or memory kept; a breaker wedged; an acknowledged DLQ record not holding the body sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from tests import chaos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--concurrency", type=int, default=40)
    args = ap.parse_args()
    report = asyncio.run(chaos.run(args.seconds, args.seed, args.concurrency))
    out = {
        "requests": report.requests,
        "client_ops": report.outcomes,
        "upstream_faults": report.upstream,
        "dlq_records_acknowledged": report.dlq_told,
        "baseline": report.baseline,
        "after": report.after,
        "problems": report.problems[:50],
        "problem_count": len(report.problems),
    }
    print(json.dumps(out, indent=2))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
