"""Tables and a plot for docs/performance.md from ``python -m hstu_cute bench --out`` JSON lines.

    python -m hstu_cute bench --out run.jsonl
    python -m hstu_cute bench --grid recsys --out run.jsonl
    python tools/perf_report.py run.jsonl --md perf-tables.md --plot docs/performance.png

Every row of one ``bench`` run carries the same run's reference lines (SDPA cuDNN and flash, on
the dense shape or the padded batch), so each table compares only lines timed together: the
report refuses a file whose rows come from more than one GPU unless ``--allow-mixed``. Output:
one markdown table per direction (forward, backward, training step) with our TF/s, the
reference lines and our ratio to cuDNN, headed by the run's GPU, time and versions; and, with
``--plot``, one bar chart of those ratios (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DIRECTIONS = (("fwd", "Forward"), ("bwd", "Backward (dq, dk, dv)"), ("step", "Training step (autograd forward + backward)"))


def load_rows(paths: list[Path]) -> list[dict]:
    """The workload rows of ``bench --out`` files (the host-overhead line and failed rows left out)."""
    rows = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{number}: not a JSON line ({exc})")
            if row.get("workload") == "host_overhead" or "error" in row or "direction" not in row:
                continue
            rows.append(row)
    return rows


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(ours, ref) -> str:
    return "-" if not ours or not ref else f"{ours / ref:.2f}x"


def tables(rows: list[dict]) -> str:
    """Markdown: the run's header, then a table per direction present in ``rows``."""
    first = rows[0]
    out = [f"{first.get('gpu', '?')}, {first.get('time', '?')}; hstu_cute {first.get('hstu_cute', '?')}, "
           f"nvidia-cutlass-dsl {first.get('dsl', '?')}, torch {first.get('torch', '?')}; kernel path "
           f"{first.get('kernel_path', '?')}. TF/s by docs/operator.md's FLOP convention; SDPA lines timed in the "
           "same run (jagged rows: the padded batch, as effective TF/s on the jagged FLOPs).", ""]
    for direction, title in DIRECTIONS:
        group = [r for r in rows if r["direction"] == direction and "entry" not in r]
        if not group:
            continue
        out += [f"**{title}**", "", "| workload | hstu-cute TF/s | ms | SDPA cuDNN TF/s | SDPA flash TF/s | x cuDNN |",
                "|---|---|---|---|---|---|"]
        for r in group:
            out.append(f"| {r['workload']} | {_fmt(r.get('tflops'))} | {r.get('ms', 0):.3f} | "
                       f"{_fmt(r.get('sdpa_cudnn'))} | {_fmt(r.get('sdpa_flash'))} | "
                       f"{_ratio(r.get('tflops'), r.get('sdpa_cudnn'))} |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """One horizontal bar chart: our ratio to the same run's cuDNN line, per workload and direction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ratios, colors = [], [], []
    palette = {"fwd": "#4c72b0", "bwd": "#dd8452", "step": "#55a868"}
    for direction, _ in DIRECTIONS:
        for r in rows:
            if r["direction"] == direction and "entry" not in r and r.get("tflops") and r.get("sdpa_cudnn"):
                labels.append(f"{direction}  {r['workload']}")
                ratios.append(r["tflops"] / r["sdpa_cudnn"])
                colors.append(palette[direction])
    if not labels:
        raise SystemExit("--plot: no row has both our TF/s and a cuDNN line")
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(labels) + 1.2))
    ax.barh(range(len(labels)), ratios, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("hstu-cute / SDPA cuDNN (same run; > 1 is faster)")
    ax.set_title(f"{rows[0].get('gpu', '?')}, {rows[0].get('time', '?')[:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # long workload names overran the left edge
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", nargs="+", type=Path, help="bench --out files of one run")
    parser.add_argument("--md", type=Path, default=None, help="write the tables here (default: stdout)")
    parser.add_argument("--plot", type=Path, default=None, help="write the ratio bar chart (PNG) here")
    parser.add_argument("--allow-mixed", action="store_true", help="accept rows from several GPUs")
    args = parser.parse_args(argv)
    rows = load_rows(args.jsonl)
    if not rows:
        raise SystemExit("no workload rows in " + ", ".join(map(str, args.jsonl)))
    gpus = sorted({r.get("gpu", "?") for r in rows})
    if len(gpus) > 1 and not args.allow_mixed:
        raise SystemExit(f"rows from several GPUs ({', '.join(gpus)}): one report per run (or --allow-mixed)")
    text = tables(rows)
    if args.md is None:
        sys.stdout.write(text + "\n")
    else:
        args.md.write_text(text + "\n", encoding="utf-8")
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
