#!/usr/bin/env python3
"""Generate the Python stubs of protos/ (pdserve/v1, inference) into the pdserve package, or check them.

    python scripts/gen_protos.py           # (re)generate into the repository (writes only
                                           # changed stubs, deletes obsolete ones)
    python scripts/gen_protos.py --check   # generate into a temp dir, compare, exit 1 if stale

The same invocation as ``python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=.
--grpc_python_out=. protos/pdserve/v1/*.proto protos/inference/*.proto`` run from the
repository root. The KServe v2 stubs (proto package ``inference``, file
``inference/grpc_predict_v2.proto``) are then moved into pdserve/kserve/, their one
``from inference import`` rewritten: the descriptor keeps the file name that any client
generating from protos/inference/ registers too. The output depends on the grpcio-tools
version (it embeds protobuf/grpc version checks), so the check is only meaningful with the
grpcio-tools version the stubs were generated with.
"""
from __future__ import annotations

import argparse
import filecmp
import logging
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

log = logging.getLogger("gen_protos")

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


@dataclass(frozen=True)
class StubSet:
    """The .proto files of one directory under protos/ and where their stubs live."""

    proto_dir: Path     # relative to protos/: protoc writes the stubs there
    package_dir: Path   # relative to the repository root: where they are kept

    def __post_init__(self) -> None:
        if self.proto_dir.is_absolute() or self.package_dir.is_absolute():
            raise ValueError("StubSet paths are relative")

    def relocate(self, out_dir: Path) -> None:
        """Move the stubs protoc wrote under ``out_dir`` to ``package_dir``, fixing imports."""
        if self.proto_dir == self.package_dir:
            return
        src, dst = out_dir / self.proto_dir, out_dir / self.package_dir
        dst.mkdir(parents=True, exist_ok=True)
        old = f"from {'.'.join(self.proto_dir.parts)} import "
        new = f"from {'.'.join(self.package_dir.parts)} import "
        for name in generated_names(src):
            text = (src / name).read_text()
            (dst / name).write_text(text.replace(old, new))
            (src / name).unlink()


STUB_SETS = (
    StubSet(Path("pdserve") / "v1", Path("pdserve") / "v1"),          # pdserve's own API
    StubSet(Path("inference"), Path("pdserve") / "kserve"),           # KServe v2 (pdserve/router/kserve)
)


def proto_files() -> list[Path]:
    """The .proto files of every stub set, relative to protos/ (sorted, for stable output)."""
    return sorted(p.relative_to(PROTO_ROOT) for s in STUB_SETS
                  for p in (PROTO_ROOT / s.proto_dir).glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) on every .proto file, writing under ``out_dir``."""
    from grpc_tools import protoc  # imported here: only needed to generate

    well_known = resources.files("grpc_tools") / "_proto"
    # Absolute disk paths: protoc maps them onto the -I root, naming them pdserve/v1/*.proto.
    files = [str(PROTO_ROOT / p) for p in proto_files()]
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    for stub_set in STUB_SETS:
        stub_set.relocate(out_dir)


def generated_names(directory: Path) -> set[str]:
    """Names of generated stub files in ``directory``."""
    if not directory.is_dir():
        return set()
    return {p.name for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


def compare(fresh_dir: Path, repo_dir: Path) -> dict[str, str]:
    """Stub file name -> "missing" / "stale" / "obsolete", for each file that differs."""
    fresh, committed = generated_names(fresh_dir), generated_names(repo_dir)
    diffs: dict[str, str] = {}
    for name in sorted(fresh | committed):
        if name not in committed:
            diffs[name] = "missing"
        elif name not in fresh:
            diffs[name] = "obsolete"
        elif not filecmp.cmp(fresh_dir / name, repo_dir / name, shallow=False):
            diffs[name] = "stale"
    return diffs


def check() -> list[str]:
    """Generate into a temp dir and list the committed stubs that differ (empty: up to date)."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for s in STUB_SETS:
            diffs = compare(Path(tmp) / s.package_dir, ROOT / s.package_dir)
            problems += [f"{what}: {s.package_dir / name}" for name, what in diffs.items()]
    return problems


def update() -> list[str]:
    """Generate into a temp dir, then copy changed stubs into the repo and delete obsolete ones.

    Unchanged files are not touched. Returns what changed.
    """
    changes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for s in STUB_SETS:
            repo_dir, fresh_dir = ROOT / s.package_dir, Path(tmp) / s.package_dir
            repo_dir.mkdir(parents=True, exist_ok=True)
            diffs = compare(fresh_dir, repo_dir)
            for name, what in diffs.items():
                if what == "obsolete":
                    (repo_dir / name).unlink()
                else:
                    shutil.copyfile(fresh_dir / name, repo_dir / name)
            changes += [f"{what} -> {'deleted' if what == 'obsolete' else 'written'}: {s.package_dir / name}"
                        for name, what in diffs.items()]
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 listing the stubs that differ from a fresh run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.check:
        problems = check()
        if problems:
            for p in problems:
                log.error("%s", p)
            log.error("stubs are out of date: run `make proto` (python scripts/gen_protos.py)")
            return 1
        log.info("stubs in %s are up to date", ", ".join(str(s.package_dir) for s in STUB_SETS))
        return 0
    changes = update()
    for change in changes:
        log.info("%s", change)
    log.info("stubs in %s are up to date (%d file(s) changed)",
             ", ".join(str(s.package_dir) for s in STUB_SETS), len(changes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
