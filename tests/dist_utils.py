"""Run a test body in N gloo processes (spawned; a FileStore rendezvous, no ports)."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    except BaseException:
        import sys
        import traceback

        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_workers(fn, world_size, *args):
    """fn(rank, world_size, *args) must be a module-level (picklable) function."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world_size, os.path.join(d, "store"), fn, args), nprocs=world_size, join=True)
