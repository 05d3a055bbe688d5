"""Precompile the shipped variants whose description matches a regex, with every CPU (GPU runs
that need one kernel family warm, not all of them).

    python scripts/warm_keys.py '^hopper_fwd_(fp8|quant_slots|vt) ' [--arch sm_90a]
"""

import argparse
import os
import re
import time

from hstu_cute import variants
from hstu_cute.warmup import warmup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pattern")
    parser.add_argument("--arch", default="sm_90a")
    args = parser.parse_args()
    keys = [k for k in variants.shipped_keys(args.arch) if re.search(args.pattern, k.describe())]
    t0 = time.time()
    results = warmup(args.arch, keys, workers=os.cpu_count(), raise_errors=False)
    bad = [r for r in results if not r["ok"]]
    print(f"warm_keys: {len(results)} keys, {len(bad)} failed, {time.time() - t0:.0f} s", flush=True)
    for r in bad[:5]:
        print("  FAILED", r["variant"], r["error"], flush=True)


if __name__ == "__main__":
    main()
