"""Regenerate the gRPC stubs in disagg/proto/ from proto/disagg.proto, the source of truth:

    python -m disagg.proto.generate           # rewrite disagg_pb2.py, disagg_pb2.pyi, disagg_pb2_grpc.py
    python -m disagg.proto.generate --check   # exit 1, naming the stale files, when they differ from fresh ones

protoc is shown proto/ under the virtual directory disagg/proto/, so the generated code imports
`from disagg.proto import disagg_pb2` and works inside the package without any line rewritten.
Fresh stubs depend on the grpcio-tools version that makes them: regenerate after upgrading it.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

STUBS_DIR = Path(__file__).resolve().parent
PROTO = STUBS_DIR.parents[1] / "proto" / "disagg.proto"
STUB_NAMES = ("disagg_pb2.py", "disagg_pb2.pyi", "disagg_pb2_grpc.py")


def generate(proto: Path = PROTO) -> dict[str, str]:
    """Fresh stubs for `proto` (a file named disagg.proto), by file name."""
    proto = proto.resolve()
    with tempfile.TemporaryDirectory() as out:
        status = protoc.main([
            "grpc_tools.protoc", f"--proto_path=disagg/proto={proto.parent}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", str(proto),
        ])
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto} (its errors are printed above)")
        return {name: (Path(out) / "disagg" / "proto" / name).read_text() for name in STUB_NAMES}


def stale_stubs(proto: Path = PROTO, stubs_dir: Path = STUBS_DIR) -> list[str]:
    """Names of the stubs in `stubs_dir` that differ from (or are missing next to) fresh ones."""
    fresh = generate(proto)
    return [name for name, text in fresh.items()
            if not (stubs_dir / name).is_file() or (stubs_dir / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the stubs are stale")
    parser.add_argument("--proto", type=Path, default=PROTO, help=f"the .proto file (default {PROTO})")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs(args.proto)
        if stale:
            print(f"stale gRPC stubs in {STUBS_DIR}: {', '.join(stale)} differ from {args.proto}; "
                  "regenerate them with: python -m disagg.proto.generate", file=sys.stderr)
            return 1
        return 0
    for name, text in generate(args.proto).items():
        (STUBS_DIR / name).write_text(text)
    print(f"wrote {', '.join(STUB_NAMES)} to {STUBS_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
