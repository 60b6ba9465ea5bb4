"""``python -m safe_zero demo``."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m safe_zero")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a tiny model with stock DeepSpeed and with safe_zero, side by side (CPU)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from safe_zero.demo import main as demo

        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
