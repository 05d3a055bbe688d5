"""Compile-time and disk-cache numbers on this machine (no GPU needed).

  python tools/measure_compile.py [ARCH]    # ARCH: sm_80 (default) or sm_90a

Prints, for a typical variant (bf16 d128 causal, no rab): cold compile in a fresh process (DSL
imported, nothing compiled yet), a second variant compiled in the same process, and the time a
*new* process needs to get the first variant from the on-disk cache."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, cutlass  # what a user process has imported before its first call
import hstu_cute.api  # what a user process imports (torch, the TVM-FFI runtime)
from hstu_cute.variants import make_fwd_key
from hstu_cute.cache import default_cache
from hstu_cute.compile import build
from hstu_cute.masks import MaskKind
t_import = time.perf_counter() - t0
arch, mode = sys.argv[1], sys.argv[2]
if arch.startswith("sm_90"):  # the Hopper (TMA + WGMMA) forward
    from hstu_cute.variants import make_hopper_fwd_key
    keys = [make_hopper_fwd_key(arch, "bfloat16", 128, MaskKind.CAUSAL, False, False),
            make_hopper_fwd_key(arch, "bfloat16", 64, MaskKind.NONE, False, False)]
else:
    keys = [make_fwd_key(arch, "bfloat16", 128, MaskKind.CAUSAL, False, False, 8),
            make_fwd_key(arch, "bfloat16", 64, MaskKind.NONE, False, False, 8)]
res = {"import_s": t_import}
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")  # a user process has initialized CUDA before its first call
for i, key in enumerate(keys if mode == "compile" else keys[:1]):
    t, c = time.perf_counter(), time.process_time()
    fn = default_cache().get(key, lambda: build(key))
    res[f"get{i}_s"], res[f"get{i}_cpu_s"] = time.perf_counter() - t, time.process_time() - c
res["stats"] = default_cache().stats.as_dict()
print(json.dumps(res))
"""

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", nargs="?", default="sm_80", help="compile target (sm_80, sm_90a)")
    arch = parser.parse_args(argv).arch
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, HSTU_CUTE_CACHE_DIR=d)
        run = lambda mode: json.loads(subprocess.run([sys.executable, "-c", CHILD, arch, mode], env=env, check=True,
                                                     capture_output=True, text=True).stdout.strip().splitlines()[-1])
        first = run("compile")
        second = run("load")
    print(f"arch {arch}, {os.cpu_count()} CPUs")
    print(f"cold compile, first variant in a fresh process: {first['get0_s']:.2f} s wall, {first['get0_cpu_s']:.2f} s CPU "
          f"(imports before it: {first['import_s']:.2f} s)")
    print(f"second variant, same process:                   {first['get1_s']:.2f} s wall, {first['get1_cpu_s']:.2f} s CPU")
    print(f"new process, first variant from the disk cache: {second['get0_s'] * 1e3:.1f} ms wall "
          f"(imports: {second['import_s']:.2f} s)")
    print("stats:", first["stats"], second["stats"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
