"""Train a small stack of HSTU blocks on synthetic jagged sequences (next-item prediction).

Every sequence walks a fixed random "catalog graph": each item has a few likely successors, so the
next item is predictable from the current one and the loss can fall from log(vocab) towards the
entropy of the walk. The model embeds item ids (plus positions), runs ``--layers`` HSTU blocks
(causal HSTU attention over the jagged batch) and scores the next item with a full softmax over
the vocabulary (the output layer shares the item embedding).

Runs on one GPU, on several with ``torchrun`` (DDP, or FSDP2 with ``--fsdp``), or on the CPU
(the blocks then run the PyTorch reference of the attention: slow, but it trains; CI does this)::

    python examples/train_hstu.py --steps 200                      # the GPU if there is one
    python examples/train_hstu.py --device cpu --steps 30
    python examples/train_hstu.py --compile                        # torch.compile, reduce-overhead
    python examples/train_hstu.py --profile-dir prof/              # torch.profiler trace of steps 10-14
    HSTU_CUTE_CACHE_DIR=/shared/hstu-cache torchrun --nproc_per_node=2 examples/train_hstu.py
    torchrun --nproc_per_node=2 examples/train_hstu.py --fsdp      # FSDP2 (fully_shard per block)

Each step's batch is a jagged batch whose lengths are a shuffle of one fixed length profile:
sequences of varied lengths, but the same token count every step, so compiled graphs (and the
CUDA graphs of ``reduce-overhead``) see one shape. The divisor ``S`` of HSTU attention is pinned
to ``--max-len`` for the same reason: it must not change with the batch.

On a GPU, one eager step runs before training (its gradients discarded): it compiles the kernel
variants the model needs, or loads them from the module cache, outside the timed steps and outside
the memory pool of the compiled CUDA graphs. Under ``torchrun``, rank 0 runs it alone while the
others wait: it fills the module cache (``HSTU_CUTE_CACHE_DIR``, shared by all ranks of the
machine), and the other ranks then load the variants from disk instead of compiling them too. Each
rank reports how many variants it compiled and how many it loaded (``cache_compiles``,
``cache_disk_hits`` in the result).

``--attention sparse`` swaps each block's attention for sparse HSTU (``hstu_cute.nsa``: compressed,
selected and window branches, gated), with block sizes scaled to ``--max-len``.

``--quant-mode`` is passed to the attention. FP8 trains on Hopper GPUs with quant modes 0-5 at
head dims 64, 128 and 256; anywhere else (CPU tensors, sm80, other head dims) the first
training step raises the library's ``NotImplementedError``, reported plainly, and the script exits
with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# Run from a checkout without installing: the package lives next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hstu_cute.nn import HSTUBlock  # noqa: E402
from hstu_cute.nsa import HSTUSparseBlock, NSAConfig  # noqa: E402

EXIT_NOT_IMPLEMENTED = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (mode reduce-overhead)")
    parser.add_argument("--quant-mode", type=int, default=-1, choices=range(-1, 6),
                        help="FP8 quant_mode of the attention; -1 = bf16 (FP8 training: Hopper, modes 0-5, head dims 64/128/256)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step and rank")
    parser.add_argument("--max-len", type=int, default=64, help="longest sequence; also the attention divisor S")
    parser.add_argument("--vocab", type=int, default=256, help="number of item ids")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--deterministic", action="store_true", help="bitwise reproducible attention backward")
    parser.add_argument("--attention", choices=("dense", "sparse"), default="dense",
                        help="dense HSTU attention, or sparse: compressed, selected and window branches "
                             "(hstu_cute.nsa, NSA-style; docs/nsa.md), with blocks scaled to --max-len")
    parser.add_argument("--cache-dir", default=None, help="sets HSTU_CUTE_CACHE_DIR (the shared module cache)")
    parser.add_argument("--out", default=None, help="write the loss curve and step times as JSON here")
    parser.add_argument("--fsdp", action="store_true",
                        help="under torchrun: FSDP2 (torch.distributed.fsdp.fully_shard per HSTU block, then the "
                             "model) instead of DDP")
    parser.add_argument("--profile-dir", default=None,
                        help="trace steps 10-14 with torch.profiler: one Chrome trace per rank here, and the "
                             "top operators (GPU time on a GPU) printed by rank 0")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.max_len < 2 or args.vocab < 2:
        parser.error("--steps, --batch-size must be >= 1; --max-len, --vocab >= 2")
    if args.attention == "sparse" and (args.quant_mode != -1 or args.deterministic):
        parser.error("--attention sparse takes neither --quant-mode nor --deterministic")
    if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        parser.error("--fsdp: run under torchrun with 2 or more processes (WORLD_SIZE >= 2)")
    return args


class CatalogWalks:
    """Synthetic sessions: from a random first item, each next item is one of ``fanout`` fixed
    successors of the current one (the first successor most likely)."""

    def __init__(self, vocab: int, batch_size: int, max_len: int, seed: int, fanout: int = 3):
        catalog = torch.Generator().manual_seed(seed)  # the same graph on every rank
        self.successors = torch.randint(0, vocab, (vocab, fanout), generator=catalog)
        self.weights = torch.tensor([0.7, 0.2, 0.1][:fanout])
        # One length profile, reshuffled each step: jagged batches of a constant token count.
        self.profile = torch.linspace(max(2, max_len // 4), max_len, batch_size).round().long()
        self.vocab, self.max_len = vocab, max_len

    def batch(self, gen: torch.Generator):
        # Every walk at once, one position at a time: a Python loop per item took 0.33 s for 41k
        # tokens, and under DDP the ranks' uneven data time showed up as all-reduce waits.
        lengths = self.profile[torch.randperm(len(self.profile), generator=gen)]
        batch, fanout = len(lengths), self.successors.shape[1]
        steps = torch.empty((self.max_len, batch), dtype=torch.long)  # position-major: each step one row
        steps[0] = torch.randint(0, self.vocab, (batch,), generator=gen)
        choices = torch.multinomial(self.weights, (self.max_len - 1) * batch, replacement=True,
                                    generator=gen).view(self.max_len - 1, batch)
        successors = self.successors.reshape(-1)
        for t in range(1, self.max_len):
            torch.index_select(successors, 0, steps[t - 1] * fanout + choices[t - 1], out=steps[t])
        walks = steps.t().contiguous()
        keep = torch.arange(self.max_len) < lengths[:, None]
        items = walks[keep]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        offsets[1:] = lengths.cumsum(0)
        positions = torch.arange(self.max_len).expand_as(walks)[keep]
        # Each position predicts the next item of its own sequence; the last one predicts nothing.
        following = torch.cat([walks[:, 1:], torch.full((len(lengths), 1), -100)], dim=1)
        following[torch.arange(len(lengths)), lengths - 1] = -100
        labels = following[keep]
        return items, positions, offsets, labels


class NextItemModel(nn.Module):
    def __init__(self, args, device):
        super().__init__()
        self.max_len = args.max_len
        self.items = nn.Embedding(args.vocab, args.d_model, device=device)
        self.positions = nn.Embedding(args.max_len, args.d_model, device=device)
        nn.init.normal_(self.items.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(self.block(args, device) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.d_model, device=device)

    @staticmethod
    def block(args, device):
        if args.attention == "sparse":
            # Short sequences here: blocks of 16 keys, a quarter of the blocks selected.
            cfg = NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, top_n=max(2, args.max_len // 64),
                            window=max(16, args.max_len // 4), num_initial=1, num_local=1)
            return HSTUSparseBlock(args.d_model, args.heads, args.head_dim, cfg=cfg, scaling_seqlen=args.max_len,
                                   device=device)
        return HSTUBlock(args.d_model, args.heads, args.head_dim, scaling_seqlen=args.max_len,
                         deterministic=args.deterministic, quant_mode=args.quant_mode, device=device)

    def forward(self, items, positions, offsets):
        x = self.items(items) + self.positions(positions)
        for block in self.blocks:
            x = block(x, offsets, self.max_len)
        return self.norm(x) @ self.items.weight.t()  # logits over the whole vocabulary


def refuse(args, error: NotImplementedError):
    """FP8 training: say plainly what is missing, exit non-zero. Anything else propagates."""
    if args.quant_mode == -1:
        raise error
    print(f"--quant-mode {args.quant_mode}: FP8 training needs a Hopper GPU, quant modes 0-5 and head dim 64, "
          f"128 or 256; train with --quant-mode -1 otherwise. The library said: {error}", file=sys.stderr)
    sys.exit(EXIT_NOT_IMPLEMENTED)


def setup_device(requested: str):
    """(device, rank, world_size); initializes the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = requested != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        return device, dist.get_rank(), world
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested), 0, 1


def _step_profiler(directory: str, rank: int, device):
    """A started torch.profiler over steps 10-14 (after 10 steps of warm-up), writing
    ``rank<r>.json`` (a Chrome trace) into ``directory``."""
    from torch.profiler import ProfilerActivity, profile, schedule

    Path(directory).mkdir(parents=True, exist_ok=True)

    def write(prof):
        prof.export_chrome_trace(str(Path(directory) / f"rank{rank}.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities,
                   schedule=schedule(wait=9, warmup=1, active=5, repeat=1), on_trace_ready=write)
    prof.start()
    return prof


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.cache_dir:
        os.environ["HSTU_CUTE_CACHE_DIR"] = args.cache_dir
    device, rank, world = setup_device(args.device)
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    data = CatalogWalks(args.vocab, args.batch_size, args.max_len, args.seed)
    model = NextItemModel(args, device)
    train_model = model
    if world > 1 and args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the embeddings and the norm; the optimizer sees the sharded parameters
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after fully_shard: its DTensor shards
    if args.compile:
        train_model = torch.compile(train_model, mode="reduce-overhead")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)  # each rank its own sessions

    def step(net, batch):
        items, positions, offsets, labels = (t.to(device, non_blocking=True) for t in batch)
        with autocast:
            logits = net(items, positions, offsets)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
        loss.backward()
        return loss

    def warm_step():
        """One eager step, gradients discarded: compiles the kernel variants (or loads them from the
        module cache), and lets the attention allocate its per-device constants outside the memory
        pool of torch.compile's CUDA graphs (which refuse a tensor that outlives a captured run)."""
        start = time.perf_counter()
        try:
            step(model, data.batch(torch.Generator().manual_seed(args.seed)))
        finally:
            model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    warm_s = None
    try:
        if world > 1 and args.fsdp:
            # Every rank at once (FSDP's all-gathers need them all): the module cache's file lock lets
            # one rank compile each variant while the other waits, then loads it.
            warm_s = warm_step()
        elif world > 1:
            import torch.distributed as dist

            # Rank 0 fills the shared module cache first; the others then load it from disk.
            if rank == 0:
                warm_s = warm_step()
            dist.barrier()
            if rank != 0:
                warm_step()
            dist.barrier()
        elif device.type == "cuda":
            warm_s = warm_step()
    except NotImplementedError as error:
        refuse(args, error)
    if warm_s is not None:
        log(f"warm step (kernels compiled or loaded from {os.environ.get('HSTU_CUTE_CACHE_DIR', 'the default cache')}): "
            f"{warm_s:.2f} s")
    from hstu_cute.cache import default_cache

    stats = default_cache().stats
    if device.type == "cuda":
        print(f"rank {rank}: {stats.compiles} kernel variants compiled, {stats.disk_hits} loaded from the module cache")

    log(f"device {device} x {world}, {sum(p.numel() for p in model.parameters()) / 1e3:.1f}k parameters, "
        f"{args.layers} HSTU blocks (H={args.heads}, D={args.head_dim}), vocab {args.vocab}, "
        f"{int(data.profile.sum())} tokens per step and rank; uniform-guess loss {math.log(args.vocab):.3f}")
    losses, step_ms = [], []
    profiler = _step_profiler(args.profile_dir, rank, device) if args.profile_dir else None
    for i in range(args.steps):
        if profiler is not None:
            profiler.step()
        batch = data.batch(gen)
        if world > 1:
            # The ranks start each timed step together: the synthetic data's time differs per rank, and
            # without this the faster rank's wait in the first all-reduce counts as step time.
            torch.distributed.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        try:
            loss = step(train_model, batch)
        except NotImplementedError as error:
            refuse(args, error)
        optimizer.step()
        value = loss.item()  # syncs: the step time below covers the whole step
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(value)
        if i % args.log_every == 0 or i == args.steps - 1:
            log(f"step {i:5d}  loss {value:.4f}  {step_ms[-1]:8.2f} ms")
    if profiler is not None:
        profiler.stop()  # the traces only: key_averages over five DDP steps ran past two minutes
    tail = max(1, len(step_ms) // 2)
    result = {"device": str(device), "world_size": world, "steps": args.steps, "compile": args.compile,
              "parallel": ("fsdp2" if args.fsdp else "ddp") if world > 1 else "none", "rank": rank,
              "cache_compiles": stats.compiles, "cache_disk_hits": stats.disk_hits,
              "warm_step_s": warm_s, "losses": losses, "step_ms": step_ms,
              "median_step_ms_second_half": sorted(step_ms[-tail:])[tail // 2],
              "tokens_per_step": int(data.profile.sum()) * world}
    log(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step {result['median_step_ms_second_half']:.2f} ms "
        f"over the second half")
    if args.out and rank == 0:
        Path(args.out).write_text(json.dumps(result))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
