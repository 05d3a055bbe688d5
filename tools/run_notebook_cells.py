"""Run the code cells of a notebook in one Python process (no Jupyter needed): a smoke test of a
notebook's GPU branches on a machine without nbclient. IPython magics (lines starting with %) are
skipped and figures are not shown.

    python tools/run_notebook_cells.py notebooks/quickstart.ipynb
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")


def main(path: str) -> None:
    notebook = Path(path).resolve()
    os.chdir(notebook.parent)  # the notebook's own directory, as Jupyter runs it
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("%"))
        start = time.perf_counter()
        print(f"--- cell {i} ---", flush=True)
        exec(compile(code, f"{notebook.name}[{i}]", "exec"), namespace)
        print(f"--- cell {i}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", help="the .ipynb file whose code cells to run")
    main(parser.parse_args().notebook)
