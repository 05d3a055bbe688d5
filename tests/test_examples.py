"""examples/train_hstu.py on CPU (the PyTorch reference path): the loss goes down, runs are
repeatable from the seed, two processes train under torchrun (gloo) with DDP and with FSDP2, and
an FP8 quant_mode stops with a clear message and a non-zero exit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_hstu.py"
SMALL = ["--device", "cpu", "--batch-size", "8", "--max-len", "32", "--vocab", "64", "--log-every", "100"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_hstu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(example, *args):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hstu_cute: CPU tensors run the PyTorch reference")
        return example.main(SMALL + list(args))


def test_training_on_cpu_lowers_the_loss_and_repeats(example, tmp_path):
    out = tmp_path / "curve.json"
    result = _train(example, "--steps", "30", "--seed", "3", "--out", str(out))
    losses = result["losses"]
    assert len(losses) == 30 and result["device"] == "cpu" and result["world_size"] == 1
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)  # from ~log(64) = 4.16; a broken model stays flat
    assert out.exists()
    again = _train(example, "--steps", "3", "--seed", "3")
    assert again["losses"] == losses[:3]  # the seed fixes data and weights


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_train(parallel, tmp_path):
    """torchrun with 2 CPU processes (gloo): DDP, or FSDP2 with --fsdp (fully_shard per block).
    The loss falls, and the result says which wrapper ran on how many ranks."""
    import json

    out = tmp_path / "curve.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
           *SMALL, "--steps", "20", "--out", str(out)] + (["--fsdp"] if parallel == "fsdp2" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["world_size"], result["parallel"], result["rank"]) == (2, parallel, 0)
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses  # from ~log(64) = 4.16


def test_fsdp_needs_torchrun(example, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        example.parse_args(["--fsdp"])
    assert exc.value.code == 2


def test_fp8_training_exits_non_zero_with_a_clear_message():
    proc = subprocess.run([sys.executable, str(EXAMPLE), *SMALL, "--steps", "2", "--quant-mode", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--quant-mode 0: FP8 training needs a Hopper GPU" in proc.stderr
    assert "quant_mode" in proc.stderr.split("The library said:")[1]


def test_bad_arguments_are_refused(example):
    with pytest.raises(SystemExit) as exc:
        example.parse_args(["--quant-mode", "7"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        example.parse_args(["--steps", "0"])


def test_sparse_attention_trains_on_cpu(example):
    """--attention sparse (hstu_cute.nsa's HSTUSparseBlock) lowers the loss on CPU too."""
    result = _train(example, "--steps", "30", "--seed", "3", "--attention", "sparse", "--max-len", "64")
    losses = result["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    with pytest.raises(SystemExit):
        example.parse_args(["--attention", "sparse", "--quant-mode", "2"])


def test_profile_dir_writes_a_trace_of_the_profiled_steps(example, tmp_path):
    """--profile-dir traces steps 10-14 into rank0.json (a Chrome trace whose events include the
    attention's reference ops on CPU), and training goes on as without it."""
    import json

    result = _train(example, "--steps", "16", "--seed", "3", "--profile-dir", str(tmp_path / "prof"))
    assert len(result["losses"]) == 16
    trace = json.loads((tmp_path / "prof" / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::matmul" in names or "aten::bmm" in names, sorted(n for n in names if n)[:20]
    steps = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps == {f"ProfilerStep#{i}" for i in range(10, 15)}, steps
