"""Command line: ``python -m rlk_ops demo | inspect | check | bench``."""
from __future__ import annotations

import argparse
import json
import sys


def _demo(args) -> int:
    from rlk_ops.rollout import demo

    report = demo.run(device=args.device, sequences=args.sequences)
    print(f"train vs rollout ({report['device']}): {report['sequences']} sequences, {report['tokens']} tokens, "
          f"page_size {report['page_size']}, prefill chunk {report['chunk']}, {report['decode_steps']} decode steps")
    print(f"mismatched tokens: {report['mismatched_tokens']} / {report['tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["mismatched_tokens"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlk_ops")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train-vs-rollout bitwise check")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
