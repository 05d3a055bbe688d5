"""tools/perf_report.py on synthetic bench --out lines (no GPU): tables, ratios, refusals, the plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("perf_report", REPO / "tools" / "perf_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lines(tmp_path, gpu="NVIDIA H200"):
    meta = dict(gpu=gpu, arch="sm_90a", kernel_path="hopper", torch="2.13", dsl="4.8.1", hstu_cute="0.1",
                time="2026-11-29T05:00:00+0000")
    rows = [dict(meta, workload="B8 N4096 D128", direction="fwd", ms=0.5, tflops=724.5, sdpa_cudnn=531.2,
                 sdpa_flash=300.0),
            dict(meta, workload="B8 N4096 D128 bwd", direction="bwd", ms=1.8, tflops=495.1, sdpa_cudnn=455.7),
            dict(meta, workload="B32 N1024 step", direction="step", ms=0.808, tflops=148.9, sdpa_cudnn=306.9),
            dict(meta, workload="broken", direction="fwd", error="OutOfMemoryError"),
            dict(meta, workload="host_overhead", api_us=30.0)]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_tables_hold_the_same_run_ratios(tmp_path, capsys):
    tool = _tool()
    assert tool.main([str(_lines(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "| B8 N4096 D128 | 724.5 | 0.500 | 531.2 | 300.0 | 1.36x |" in out
    assert "| B8 N4096 D128 bwd | 495.1 | 1.800 | 455.7 | - | 1.09x |" in out
    assert "| B32 N1024 step | 148.9 | 0.808 | 306.9 | - | 0.49x |" in out
    assert "broken" not in out and "host_overhead" not in out


def test_mixed_gpus_are_refused_and_the_plot_is_written(tmp_path):
    tool = _tool()
    a = _lines(tmp_path)
    b = tmp_path / "other.jsonl"
    b.write_text(a.read_text().replace("NVIDIA H200", "NVIDIA H100"))
    with pytest.raises(SystemExit, match="several GPUs"):
        tool.main([str(a), str(b)])
    pytest.importorskip("matplotlib")
    png = tmp_path / "perf.png"
    md = tmp_path / "perf.md"
    assert tool.main([str(a), "--md", str(md), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "x cuDNN" in md.read_text()
