"""Instructions per iteration of a kernel's innermost GEMM loop, from its SASS, on a machine
without a GPU: the static stand-in for ncu's executed-instruction counts when a kernel is
issue-bound (the FP8 backward kernels, docs/dev/perf-log.md session 19). Each matching shipped
variant is compiled on fake tensors with its cubin kept, disassembled with ``cuobjdump -sass``
(CUDA toolkit; on PyPI in ``nvidia-cuda-cuobjdump``: ``--tools DIR`` names its bin folder), and
the smallest loop (a backward branch) holding a GMMA instruction is counted by opcode along its
main path: forward branches inside the loop whose skipped code holds no GMMA (masking, zeroing
rows past the sequence, rescales when a row scale grows) are taken as jumps, and branches out of
the loop (barrier retry) as not taken.

    python tools/sass_counts.py --only "hopper_bwd_fp8_dkdv sm_90a float8_e4m3fn d128 .* causal ->bfloat16$"

``--waits`` adds where the loop's WGMMA waits (``WARPGROUP.DEPBAR.LE gsb0, N``) sit, counted in
MUFU ops before them, and the local loads/stores of the whole kernel: ptxas may hoist a wait
above the SiLU it was written after (docs/design/fp8-forward.md section 9). ``--set FIELD=VALUE``
builds the matching keys with a field changed (e.g. ``early_silu=true``, ``tile_n=160``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile

from ptx_digests import dumped_build  # tools/: the same compile, another dumped file

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b(?:\s+\S+,)?\s+0x([0-9a-f]+)")


def parse(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def innermost_gemm_loop(ins: list[tuple[int, str]]) -> tuple[int, int]:
    """(first, last) index of the smallest loop (a backward branch) holding a GMMA instruction."""
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
    return start, end


def waits(ins: list[tuple[int, str]]) -> str:
    """Each WGMMA wait of the innermost GEMM loop as ``LE<n>@<MUFU ops before it>``, in order."""
    start, end = innermost_gemm_loop(ins)
    mufu, marks = 0, []
    for _, text in ins[start:end + 1]:
        mufu += opcode(text) == "MUFU"
        m = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", text)
        if m:
            marks.append(f"LE{int(m.group(1), 16)}@{mufu}")
    local = sum(opcode(t) in ("LDL", "STL") for _, t in ins)
    return f"waits {' '.join(marks)} of {mufu} MUFU; {local} local loads/stores in the kernel"


def main_path(ins: list[tuple[int, str]]) -> tuple[list[str], int]:
    """(opcodes along the innermost GEMM loop's main path, its static size)."""
    where = {a: i for i, (a, _) in enumerate(ins)}
    start, end = innermost_gemm_loop(ins)
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
    ap.add_argument("--waits", action="store_true", help="also where the loop's WGMMA waits sit")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="build the keys with fields changed")
    args = ap.parse_args()
    from hstu_cute.variants import shipped_keys

    cuobjdump = shutil.which("cuobjdump", path=args.tools) if args.tools else shutil.which("cuobjdump")
    if cuobjdump is None:
        raise SystemExit("cuobjdump not found: install the CUDA toolkit or nvidia-cuda-cuobjdump, or pass --tools")
    keys = [k for k in shipped_keys(args.arch) if any(re.search(p, k.describe()) for p in args.only)]
    if not keys:
        raise SystemExit("no shipped variant matches")
    if args.set:
        fields = {}
        for item in args.set:
            name, value = item.split("=", 1)
            fields[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
        keys = [dataclasses.replace(k, **fields) for k in keys]
    os.environ.update(CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=tempfile.mkdtemp(prefix="hstu-sass-"))
    for key in keys:
        ins = parse(sass_of(key, cuobjdump))
        path, size = main_path(ins)
        counts = collections.Counter(path)
        uniform = sum(v for k, v in counts.items() if k.startswith("U"))
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(args.top))
        print(f"{key.describe()}: {len(path)} on the main path of a {size}-instruction loop "
              f"({uniform} uniform): {top}" + (f"; {waits(ins)}" if args.waits else ""), flush=True)


if __name__ == "__main__":
    main()
