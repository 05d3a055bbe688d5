"""One PTX digest per shipped kernel variant: the proof that a refactor left the kernels alone.

    python tools/ptx_digests.py --arch sm_80 sm_90a --workers 2 --out digests.txt
    python tools/ptx_digests.py --compare before.txt after.txt

Each variant of ``hstu_cute.variants.shipped_keys(arch)`` is compiled on fake tensors (no GPU)
with the DSL's PTX dump on; the digest is the SHA-256 of that PTX with the generated kernel
symbol (which spells the Python module and class path) replaced by one placeholder, so that
moving a kernel class between modules does not count as a change, while any instruction,
register, parameter or constant does. Output: ``<digest> <variant description>`` per line, in the
shipped order. ``--compare`` matches two outputs line by line and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import re
import sys
import tempfile
from pathlib import Path

_KERNEL_SYMBOL = re.compile(rb"kernel_cutlass_\w+")


def normalized_digest(ptx: bytes) -> str:
    return hashlib.sha256(_KERNEL_SYMBOL.sub(b"KERNEL", ptx)).hexdigest()[:16]


def _worker_init(dump_root: str) -> None:
    dump = tempfile.mkdtemp(dir=dump_root)
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump


def dumped_build(key, suffix: str) -> list[Path]:
    """Compile ``key`` as the module cache does (export mode, no JIT engine: that path verifies
    the IR) and return the files the DSL dumped with ``suffix`` ("ptx", "cubin"): those the
    CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR of this process (read at its first compile) ask for."""
    from hstu_cute import cache
    from hstu_cute.compile import build

    dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    for stale in dump.glob(f"*.{suffix}"):
        stale.unlink()
    os.environ["CUTE_DSL_ARCH"] = key.arch
    token = cache._BUILDING_FOR_EXPORT.set(True)
    try:
        build(key)
    finally:
        cache._BUILDING_FOR_EXPORT.reset(token)
    files = sorted(dump.glob(f"*.{suffix}"))
    if not files:
        raise RuntimeError(f"{key.describe()}: the DSL wrote no {suffix}")
    return files


def _digest_one(key) -> tuple[str, str]:
    digest = normalized_digest(b"".join(p.read_bytes() for p in dumped_build(key, "ptx")))
    return digest, key.describe()


def compute(archs: list[str], workers: int, every_arch_pair: bool = False, only: list[str] | None = None) -> list[str]:
    from hstu_cute.variants import shipped_keys

    keys = []
    for arch in archs:
        # The sm80 kernels' PTX for sm_90a differs from their sm_80 PTX only in the target line:
        # with both archs asked for, each kernel family is digested once (as CI compiles them).
        keys += [k for k in shipped_keys(arch)
                 if not (not every_arch_pair and arch.startswith("sm_90") and "sm_80" in archs
                         and k.kernel_name.startswith("ampere"))]
    if only:
        keys = [k for k in keys if any(re.search(pattern, k.describe()) for pattern in only)]
    with tempfile.TemporaryDirectory() as root:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, initializer=_worker_init, initargs=(root,)) as pool:
            lines = []
            for i, (digest, label) in enumerate(pool.imap(_digest_one, keys), 1):
                lines.append(f"{digest} {label}")
                print(f"[{i}/{len(keys)}] {digest} {label}", file=sys.stderr, flush=True)
    return lines


def compare(before: Path, after: Path) -> int:
    a, b = ([line for line in p.read_text().splitlines() if line and not line.startswith("#")] for p in (before, after))
    if len(a) != len(b):
        print(f"variant count differs: {len(a)} vs {len(b)}")
        return 1
    differ = [(x, y) for x, y in zip(a, b) if x.split()[0] != y.split()[0]]
    for x, y in differ:
        print(f"differs: {x}\n     vs: {y}")
    print(f"{len(a) - len(differ)} of {len(a)} variants byte-identical in PTX")
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90a"], help="cubin targets")
    parser.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--out", type=Path, default=None, help="write the digests here (default: stdout)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), default=None,
                        help="compare two digest files instead of compiling")
    parser.add_argument("--every-arch-pair", action="store_true",
                        help="also digest the sm80 kernels for sm_90a when sm_80 is asked for")
    parser.add_argument("--only", nargs="+", default=None, metavar="REGEX",
                        help="only the variants whose description matches one of these")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    text = "\n".join(compute(args.arch, args.workers, args.every_arch_pair, args.only)) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
