"""Compare the committed gRPC code (ftagent/v1/) with what proto/ generates now.

Why a script and not `diff -r`: grpcio-tools and protoc stamp their own version into the
generated files (`GRPC_GENERATED_VERSION = '1.85.4'`, `# Protobuf Python Version: ...`,
the runtime-version check's numbers). A patch release of the generator changes those lines
and nothing else, and a fresh clone's `make test` failed on exactly that. The check is
about the schema: the version stamps are masked on both sides, everything else must match.

Usage: python proto/check_generated.py GENERATED_DIR COMMITTED_DIR   (exit 1 when stale)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_STAMPS = (
    # grpc: GRPC_GENERATED_VERSION = '1.85.1'
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M), "GRPC_GENERATED_VERSION = '*'"),
    # protobuf: "# Protobuf Python Version: 7.35.1"
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: *"),
    # protobuf: ValidateProtobufRuntimeVersion(Domain.PUBLIC, 7, 35, 1, '', 'file.proto')
    (
        re.compile(r"(ValidateProtobufRuntimeVersion\(\s*[\w.]+,)\s*\d+,\s*\d+,\s*\d+,\s*'[^']*',"),
        r"\1 *,",
    ),
)


def normalized(text: str) -> str:
    """The file's text with the generator's version stamps masked."""
    for pattern, replacement in _STAMPS:
        text = pattern.sub(replacement, text)
    return text


def stale_files(generated: Path, committed: Path) -> list[str]:
    """Names of the generated files whose schema part differs from the committed one."""
    names = {p.name for p in generated.iterdir() if p.suffix in (".py", ".pyi")}
    names |= {p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi")}
    names.discard("__init__.py")
    stale = []
    for name in sorted(names):
        new, old = generated / name, committed / name
        if not (new.is_file() and old.is_file()):
            stale.append(name)
        elif normalized(new.read_text()) != normalized(old.read_text()):
            stale.append(name)
    return stale


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    stale = stale_files(Path(argv[0]), Path(argv[1]))
    if stale:
        print(f"ftagent/v1 is stale ({', '.join(stale)}): run 'make proto' and commit")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
