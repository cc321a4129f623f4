"""Markdown summary of a pytest JUnit XML report: counts, wall time, failures with their messages,
the slowest tests. Used by ``benchmarks/gpu_tests.sh``:

    python3 benchmarks/gpu_tests_summary.py OUT/gpu_tests.xml --wall SECONDS --command CMD [--log LOG]
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("xml", type=Path)
    ap.add_argument("--wall", type=float, required=True, help="seconds the whole script took")
    ap.add_argument("--command", required=True)
    ap.add_argument("--log", type=Path, help="the pytest log (its header lines are quoted)")
    args = ap.parse_args()
    cases = []
    for case in ET.parse(args.xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or node.text or "").strip()
                break
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cases.append((name, outcome, float(case.get("time") or 0.0), message))
    counts = {k: sum(c[1] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    print(f"# GPU tests: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped of {len(cases)} in {args.wall:.0f} s\n")
    print(f"Command (repository root, device machine): `{args.command}`\n")
    if args.log and args.log.exists():
        head = [ln for ln in args.log.read_text().splitlines()[:4] if not ln.startswith("files:")]
        print("```\n" + "\n".join(head) + "\n```\n")
    bad = [c for c in cases if c[1] in ("failed", "error")]
    if bad:
        print("## Failures\n")
        for name, outcome, seconds, message in bad:
            first = re.sub(r"\s+", " ", message)[:600]
            print(f"- `{name}` ({outcome}, {seconds:.1f} s): {first}")
        print()
    skipped = [c for c in cases if c[1] == "skipped"]
    if skipped:
        print("## Skipped\n")
        for name, _, _, message in skipped:
            reason = re.sub(r"\s+", " ", message)[:200]
            print(f"- `{name}`: {reason}")
        print()
    print("## Slowest\n\n| test | outcome | s |\n|---|---|---|")
    for name, outcome, seconds, _ in sorted(cases, key=lambda c: -c[2])[:12]:
        print(f"| `{name}` | {outcome} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
