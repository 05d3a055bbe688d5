"""Instructions per iteration of a kernel's innermost GEMM loop, from its SASS, on a machine
without a GPU: the static stand-in for ncu's executed-instruction counts when a kernel is
issue-bound (the FP8 backward kernels, docs/perf-log.md session 19). Each matching shipped
variant is compiled on fake tensors with its cubin kept, disassembled with ``cuobjdump -sass``
(CUDA toolkit; on PyPI in ``nvidia-cuda-cuobjdump``: ``--tools DIR`` names its bin folder), and
the smallest loop (a backward branch) holding a GMMA instruction is counted by opcode along its
main path: forward branches inside the loop whose skipped code holds no GMMA (masking, zeroing
rows past the sequence, rescales when a row scale grows) are taken as jumps, and branches out of
the loop (barrier retry) as not taken.

    python scripts/sass_counts.py --only "hopper_bwd_fp8_dkdv sm_90a float8_e4m3fn d128 .* causal ->bfloat16$"
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile

from ptx_digests import dumped_build  # scripts/: the same compile, another dumped file

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b(?:\s+\S+,)?\s+0x([0-9a-f]+)")


def parse(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_path(ins: list[tuple[int, str]]) -> tuple[list[str], int]:
    """(opcodes along the innermost GEMM loop's main path, its static size)."""
    where = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        m = _BRANCH.search(text)
        # A loop's back edge is conditional; an unconditional one returns from an out-of-line
        # barrier retry to its wait.
        if m and text.startswith("@") and int(m.group(1), 16) < a and int(m.group(1), 16) in where:
            start = where[int(m.group(1), 16)]
            if any("GMMA" in opcode(t) for _, t in ins[start:i]):
                loops.append((i - start, start, i))
    if not loops:
        raise RuntimeError("no loop with a GMMA instruction")
    _, start, end = min(loops)
    path, i = [], start
    while i <= end:
        a, text = ins[i]
        path.append(opcode(text))
        m = _BRANCH.search(text)
        if m and i < end:
            target = int(m.group(1), 16)
            if a < target <= ins[end][0] and not any("GMMA" in opcode(t) for _, t in ins[i + 1:where[target]]):
                i = where[target]
                continue
        i += 1
    return path, end - start + 1


def sass_of(key, cuobjdump: str) -> str:
    """``key``'s SASS (the process's DSL dump folder keeps its cubin)."""
    return "".join(subprocess.run([cuobjdump, "-sass", str(c)], check=True, capture_output=True, text=True).stdout
                   for c in dumped_build(key, "cubin"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", required=True, metavar="REGEX", help="variant descriptions to count")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--tools", default=None, help="folder holding cuobjdump (default: PATH)")
    ap.add_argument("--top", type=int, default=16, help="opcodes listed per variant")
    args = ap.parse_args()
    from hstu_cute.variants import shipped_keys

    cuobjdump = shutil.which("cuobjdump", path=args.tools) if args.tools else shutil.which("cuobjdump")
    if cuobjdump is None:
        raise SystemExit("cuobjdump not found: install the CUDA toolkit or nvidia-cuda-cuobjdump, or pass --tools")
    keys = [k for k in shipped_keys(args.arch) if any(re.search(p, k.describe()) for p in args.only)]
    if not keys:
        raise SystemExit("no shipped variant matches")
    os.environ.update(CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=tempfile.mkdtemp(prefix="hstu-sass-"))
    for key in keys:
        path, size = main_path(parse(sass_of(key, cuobjdump)))
        counts = collections.Counter(path)
        uniform = sum(v for k, v in counts.items() if k.startswith("U"))
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(args.top))
        print(f"{key.describe()}: {len(path)} on the main path of a {size}-instruction loop "
              f"({uniform} uniform): {top}", flush=True)


if __name__ == "__main__":
    main()
