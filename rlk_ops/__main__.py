"""Command line: ``python -m rlk_ops demo | inspect | describe | check``."""
from __future__ import annotations

import argparse
import json
import math
import sys


def _positive_int(text: str) -> int:
    """argparse type: an int > 0 (the message names the expected and the given value)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _seed(text: str) -> int:
    """argparse type: a sampler / weights seed, an int in [0, 2**32)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**32), got {text!r}") from None
    if not 0 <= value < 2 ** 32:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**32), got {value}")
    return value


MAX_PAGE_SIZE = 4096
# the demo model's sizes: far past anything the demo needs, short of what the allocator refuses with a
# traceback and exit 1 (which means "rollout and training disagree"; a session 38 audit)
MAX_LAYERS = 256
MAX_SEQUENCES = 4096


def _at_most(limit: int, what: str):
    """argparse type: an int in [1, limit]."""
    def parse(text: str) -> int:
        value = _positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected {what} in [1, {limit}], got {value}")
        return value
    return parse


def _page_size(text: str) -> int:
    """argparse type: a page size in [1, MAX_PAGE_SIZE] (10**8 once reached the allocator)."""
    value = _positive_int(text)
    if value > MAX_PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"expected a page size in [1, {MAX_PAGE_SIZE}], got {value}")
    return value


def _preflight(parser: argparse.ArgumentParser, args) -> None:
    """What would otherwise fail after the job ran, or deep inside it: a CUDA device that is
    not there, an output file whose folder does not exist, describe's model options."""
    import os

    import torch

    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:   # the likelier cause on a GPU machine: pip gave a CPU build
            parser.error(f"--device cuda: this torch ({torch.__version__}) is a CPU build; install a CUDA build "
                         f"of torch 2.11-2.13 (e.g. into .venv)")
        parser.error("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    for flag in ("json", "out"):
        path = getattr(args, flag, None)
        if isinstance(path, str):
            if not path:
                parser.error(f"--{flag} needs a file path, got an empty string")
            if os.path.isdir(path):
                parser.error(f"--{flag} {path}: is a folder; give a file path in it")
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                parser.error(f"--{flag} {path}: the folder {folder} does not exist")
    if args.command == "demo" and args.hf_model is not None:
        if args.layers is not None:
            parser.error(f"--layers {args.layers} with --hf-model: the checkpoint's config gives the layer count")
        if not os.path.isfile(os.path.join(args.hf_model, "config.json")):
            parser.error(f"--hf-model {args.hf_model}: expected a folder holding a transformers checkpoint "
                         f"(config.json and the weights, as save_pretrained writes them), found no config.json")
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            parser.error("--hf-model needs transformers: pip install transformers (the test extra pins it)")
    if args.command == "demo":
        from rlk_ops.meta.contract import SplitKVPolicy

        if SplitKVPolicy.parse(args.split_kv).kind not in ("disabled", "canonical"):
            parser.error(f"--split-kv {args.split_kv}: the demo compares rollout with training, which computes "
                         f"disabled or canonical:C only (fixed:N and auto are rollout-only lanes)")
    if args.command == "describe":
        from rlk_ops.rollout.model import TinyQwen3Config

        try:
            cfg = TinyQwen3Config(num_layers=args.layers, split_kv=args.split_kv, rope_theta=args.rope_theta,
                                  rms_norm_eps=args.rms_norm_eps)
        except ValueError as e:
            parser.error(str(e))
        if args.model_id is not None and not args.model_id.strip():
            parser.error(f"--model-id must be a non-empty checkpoint id (or left out: the weights' sha256), "
                         f"got {args.model_id!r}")
        for flag in ("tp", "cp"):   # a side described with tp or cp > 1 states no ownership: it never bound
            if getattr(args, flag) != 1:
                parser.error(f"--{flag} {getattr(args, flag)}: describe runs the unsharded demo model in one "
                             f"process, so --{flag} must be 1 (a side with {flag} > 1 must state which heads or "
                             f"tokens it owns: rlk_ops.meta.probe.Topology, from Python)")
        entries = args.entries.split(",")
        if not entries or any(e not in ("prefill", "decode") for e in entries):
            parser.error(f"--entries must be prefill, decode or prefill,decode, got {args.entries!r}")


def _split_kv(text: str) -> str:
    """argparse type: a split-KV policy string SplitKVPolicy.parse accepts (canonical:C checked here)."""
    from rlk_ops.meta.contract import SplitKVPolicy

    try:
        SplitKVPolicy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _demo(args) -> int:
    import rlk_ops
    from rlk_ops.rollout import demo

    if args.no_strict:
        rlk_ops.set_strict_mode(False)
    report = demo.run(device=args.device, layers=args.layers or 2, sequences=args.sequences,
                      split_kv=args.split_kv, chunk=args.chunk, page_size=args.page_size,
                      max_running=args.max_running, seed=args.seed, greedy=args.greedy,
                      backward=not args.no_backward, progress=not args.quiet, compile=args.compile,
                      hf_model=args.hf_model)
    print(demo.summary(report))
    if args.json is not None and not _write_json(report, args.json, "--json", indent=2):
        return 2
    return demo.exit_code(report)


def _strict_json(obj):
    """``obj`` with every non-finite float written as the string "inf", "-inf" or "nan": json.dump's
    bare Infinity / NaN is no JSON other parsers take (a drift of a NaN or an infinity; session 35)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def _write_json(obj, path: str, flag: str, indent: int) -> bool:
    """Write ``obj`` to ``path`` as strict JSON (non-finite floats as strings); on failure say so and
    return False (a traceback after the job's result, with exit 1, read as "rollout and training
    disagree"; a session 34 audit)."""
    try:
        with open(path, "w") as f:
            json.dump(_strict_json(obj), f, indent=indent, allow_nan=False)
    except OSError as e:
        print(f"error: {flag} {path}: cannot write it: {e}", file=sys.stderr)
        return False
    return True


def _inspect(args) -> int:
    import torch

    from rlk_ops.compile import Qwen3Attention, inspect_boundary
    from rlk_ops.compile.boundary import dumps
    from rlk_ops.compile.examples import decode_batch, init_block, packed_batch

    block = init_block(Qwen3Attention())  # Qwen3-8B TP=2 shard: hidden 4096, 16 q / 4 kv heads, head_dim 128
    cfg = block.config
    x, pos, cu = packed_batch([5, 11], cfg.hidden_size)
    reports = {"training": inspect_boundary(block, x, pos, cu)}
    with torch.no_grad():
        reports["decode"] = inspect_boundary(block.forward_rollout, *decode_batch(block, [7, 130]))
    if args.json:
        print(dumps(reports))
    else:
        for name, rep in reports.items():
            print(rep.table(f"== Qwen3Attention {name} graph (hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
                            f"{cfg.num_kv_heads}, head_dim {cfg.head_dim}) =="))
            print()
    return 0 if all(r.graph_breaks == 0 and r.skipped_frames == 0 and not r.leaks and not r.outside_calls
                    for r in reports.values()) else 1


def _check(args) -> int:
    from rlk_ops.meta.binding import bind, load_side

    try:
        train, rollout = load_side(args.train, "train"), load_side(args.rollout, "rollout")
    except (OSError, ValueError) as e:
        print(f"check: {e}", file=sys.stderr)
        if args.json:   # a refusal is an answer too: stdout had nothing to parse
            print(json.dumps({"refused": str(e)}, indent=2))
        return 2
    result = bind(train, rollout)
    # strict JSON: a value the binding turned into inf (1e39 as a float32 scale) was printed as Infinity
    print(json.dumps(_strict_json(result.to_json()), indent=2, allow_nan=False) if args.json else result.summary())
    return 0 if result.comparable and result.passed else 1


def _describe(args) -> int:
    import rlk_ops
    from rlk_ops.meta import probe
    from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config

    if args.no_strict:
        rlk_ops.set_strict_mode(False)
    cfg = TinyQwen3Config(num_layers=args.layers, split_kv=args.split_kv, rope_theta=args.rope_theta,
                          rms_norm_eps=args.rms_norm_eps)
    model = TinyQwen3(cfg, device=args.device, seed=args.seed)
    topology = probe.Topology(tp=args.tp, cp=args.cp)
    if args.side == "train":
        side = probe.describe_train(model, model_id=args.model_id, topology=topology)
    else:
        side = probe.describe_rollout(model, page_size=args.page_size, model_id=args.model_id, topology=topology,
                                      entries=tuple(args.entries.split(",")))
    if not _write_json(side, args.out, "--out", indent=1):
        return 2
    print(f"wrote the {args.side} side of the demo model to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlk_ops")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train-vs-rollout bitwise check")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=_at_most(MAX_LAYERS, "a layer count"), default=None,
                   help="the demo model's layer count (default 2)")
    p.add_argument("--hf-model", default=None, metavar="DIR",
                   help="a local transformers Qwen3 checkpoint folder to run in place of the demo model (bf16, "
                        "every stage on rlk ops: rlk_ops.compile.hf_model; needs transformers)")
    p.add_argument("--sequences", type=_at_most(MAX_SEQUENCES, "a sequence count"), default=8)
    p.add_argument("--split-kv", type=_split_kv, default="disabled",
                   help="disabled | canonical (= canonical:768) | canonical:C (training and rollout must share "
                        "the policy; fixed:N and auto are rollout-only lanes that no training forward computes)")
    p.add_argument("--chunk", type=_positive_int, default=96, help="prefill chunk size (tokens)")
    p.add_argument("--page-size", type=_page_size, default=16)
    p.add_argument("--max-running", type=_positive_int, default=4, help="sequences decoding at once")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--greedy", action="store_true", help="greedy instead of the seeded sampler")
    p.add_argument("--compile", action="store_true",
                   help="run the rollout under torch.compile (Inductor); the trainer stays eager")
    p.add_argument("--no-backward", action="store_true", help="skip the training backward check")
    p.add_argument("--no-strict", action="store_true", help="allow recorded fallbacks")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(func=_demo)
    p = sub.add_parser("inspect", help="FX boundary report of the default block's training and decode graphs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("check", help="bind a training and a rollout side description (exit 0: comparable and passed)")
    p.add_argument("--train", required=True, help="side description JSON (python -m rlk_ops describe)")
    p.add_argument("--rollout", required=True, help="side description JSON")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_check)
    p = sub.add_parser("describe", help="write a side description of the demo model (warm-up compile + provenance)")
    p.add_argument("--side", required=True, choices=["train", "rollout"])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=_at_most(MAX_LAYERS, "a layer count"), default=2)
    p.add_argument("--seed", type=_seed, default=0, help="weights seed")
    p.add_argument("--model-id", default=None, help="checkpoint id (default: sha256 of the weights)")
    p.add_argument("--split-kv", type=_split_kv, default="disabled")
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--rms-norm-eps", type=float, default=1e-6)
    p.add_argument("--page-size", type=_page_size, default=16, help="rollout only")
    p.add_argument("--entries", default="prefill,decode", help="rollout only: prefill, decode or both")
    p.add_argument("--tp", type=_positive_int, default=1)
    p.add_argument("--cp", type=_positive_int, default=1)
    p.add_argument("--no-strict", action="store_true", help="allow recorded fallbacks")
    p.set_defaults(func=_describe)
    args = parser.parse_args(argv)
    _preflight(parser, args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
