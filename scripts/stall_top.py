"""The SASS instructions with the most warp stall samples, from an Nsight Compute source-page CSV
(``ncu -i REPORT --page source --csv --print-source sass > F``), with each one's stall reasons:
where a latency-bound kernel's warps wait (docs/design/fp8-forward.md section 9).

    python scripts/stall_top.py F.csv [--top 40]

Column names differ between ncu versions: the sample count is the first column whose name holds
"Sampling" and "All" (else "Sampling"), the reasons every other numeric column whose name holds
"stall"; without them the header is printed so that the next run can name them."""

from __future__ import annotations

import argparse
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header_at = next((i for i, r in enumerate(rows) if any("Sampling" in c for c in r)), None)
    if header_at is None:
        print("no sampling column; first lines:", *rows[:3], sep="\n")
        sys.exit(1)
    header, body = rows[header_at], rows[header_at + 1:]
    sampled = [i for i, c in enumerate(header) if "Sampling" in c]
    total_col = next((i for i in sampled if "All" in header[i]), sampled[0])
    source_col = next((i for i, c in enumerate(header) if c.strip().lower() == "source"), 1)
    address_col = next((i for i, c in enumerate(header) if "Address" in c), 0)
    reasons = [i for i, c in enumerate(header) if "stall" in c.lower() and i != total_col and i not in sampled]
    total = sum(number(r[total_col]) for r in body if len(r) > total_col)
    print(f"{len(body)} instructions, {total:.0f} samples in '{header[total_col]}'")
    if not reasons:
        print("no per-reason columns; header:", header)
    ranked = sorted((r for r in body if len(r) > total_col), key=lambda r: -number(r[total_col]))
    for r in ranked[:args.top]:
        why = sorted(((number(r[i]), header[i]) for i in reasons if number(r[i]) > 0), reverse=True)[:3]
        print(f"{number(r[total_col]) / max(total, 1) * 100:5.1f}%  {r[address_col]:>6}  {r[source_col][:60]:<60}  "
              + ", ".join(f"{name} {v:.0f}" for v, name in why))


if __name__ == "__main__":
    main()
