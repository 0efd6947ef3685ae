"""Regenerates the protobuf Python code from proto/siphon.proto.

`python -m siphon_core.wire.generate` writes siphon_pb2.py beside this file;
`--check` exits non-zero when the committed code differs from a fresh build.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

WIRE_DIR = Path(__file__).resolve().parent
PROTO_DIR = WIRE_DIR.parent.parent / "proto"
PROTO_FILE = PROTO_DIR / "siphon.proto"
GENERATED = ("siphon_pb2.py", "siphon_pb2.pyi")


def _compile(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only the set-up compiles

    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", str(PROTO_FILE)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO_FILE}")


def stale_files() -> list[str]:
    """Names of generated files that differ from what the .proto produces now."""
    with tempfile.TemporaryDirectory() as tmp:
        _compile(Path(tmp))
        return [
            name
            for name in GENERATED
            if not (WIRE_DIR / name).exists()
            or (WIRE_DIR / name).read_bytes() != (Path(tmp) / name).read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when the generated code is stale")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run python -m siphon_core.wire.generate")
            return 1
        return 0
    if not PROTO_FILE.exists():
        # An installed (non-editable) copy ships the generated code only.
        return 0
    stale = stale_files()
    if stale:
        _compile(WIRE_DIR)
        if not args.quiet:
            print(f"regenerated {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
