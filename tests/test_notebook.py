"""notebooks/quickstart.ipynb executes without errors (CPU cells run; kernel cells print a skip
message and GPU measurements come from the stored GPU results), and the committed copy is
executed and small."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
STORED = NOTEBOOK.parent / "gpu_results.json"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")


def _kernel_manager(tmp_path):
    """A kernel running this interpreter (this venv), whatever kernelspecs the machine has."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = tmp_path / "kernels" / "hstu-cute-test"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "hstu-cute test", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name="hstu-cute-test", kernel_spec_manager=ksm)


def test_quickstart_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path), timeout=600, startup_timeout=120,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    import torch

    stored = json.loads(STORED.read_text())
    if not torch.cuda.is_available():
        assert "No CUDA GPU: skipped the kernel" in text and "No CUDA GPU: plotting stored results" in text
        # Every stored number is labelled as such, with the run's date and commit.
        assert f"{stored['date']}, commit {stored['commit']}), not measured here" in text
    assert "hstu_cute.fwd" in text  # the export cell traced the custom op
    assert "== jagged call: True" in text and "rows past each length are zero: True" in text
    losses = [float(x) for x in text.split("compiled training steps, loss:")[1].splitlines()[0].split()]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], losses
    assert "output x 0.500" in text and "scaling_seqlen=12: output x 1.000" in text  # the 1/S cell
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3, "the mask figure, the training curves and the performance plot"


def test_stored_gpu_results_are_complete():
    """The stored GPU results the notebook shows without a GPU: every section, with provenance."""
    stored = json.loads(STORED.read_text())
    assert stored["commit"] and stored["date"] and stored["gpu"].startswith("NVIDIA")
    assert len(stored["forward_tflops"]) == 4 and all(r["tflops"] > 0 for r in stored["forward_tflops"])
    assert {"eager", "compiled"} <= set(stored["training_example"])
    assert {"cold_compile", "disk_load", "warmup"} <= set(stored["module_cache"])
    assert stored["padded"]["max_abs_diff_padded_vs_jagged"] == 0.0


def test_committed_notebook_is_executed_and_small():
    assert NOTEBOOK.stat().st_size < 500_000
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), "commit the notebook executed"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
