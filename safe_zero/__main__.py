"""``python -m safe_zero demo`` and ``python -m safe_zero doctor``."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m safe_zero")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a tiny model with stock DeepSpeed and with safe_zero, side by side (CPU)")
    doctor = sub.add_parser("doctor", help="which DeepSpeed defects this installation has, and what safe_zero does")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("model", nargs="?", help="'package.module:factory' or a local Hugging Face model directory")
    args = parser.parse_args(argv)
    from safe_zero.errors import StaleBuildLockError

    try:
        if args.command == "demo":
            from safe_zero.demo import main as demo

            return demo()
        from safe_zero.doctor import main as run_doctor

        return run_doctor(args.json, args.model)
    except StaleBuildLockError as e:
        parser.exit(1, f"safe_zero: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
