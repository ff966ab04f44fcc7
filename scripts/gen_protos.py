#!/usr/bin/env python3
"""Generate the Python stubs of protos/pdserve/v1/*.proto into pdserve/v1/, or check them.

    python scripts/gen_protos.py           # (re)generate into the repository (writes only
                                           # changed stubs, deletes obsolete ones)
    python scripts/gen_protos.py --check   # generate into a temp dir, compare, exit 1 if stale

The same invocation as ``python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=.
--grpc_python_out=. protos/pdserve/v1/*.proto`` run from the repository root. The output
depends on the grpcio-tools version (it embeds protobuf/grpc version checks), so the check
is only meaningful with the grpcio-tools version the stubs were generated with.
"""
from __future__ import annotations

import argparse
import filecmp
import logging
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

log = logging.getLogger("gen_protos")

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("pdserve") / "v1"  # relative to the output root
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto files of the contract, relative to protos/ (sorted, for stable output)."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) on every .proto file, writing under ``out_dir``."""
    from grpc_tools import protoc  # imported here: only needed to generate

    well_known = resources.files("grpc_tools") / "_proto"
    # Absolute disk paths: protoc maps them onto the -I root, naming them pdserve/v1/*.proto.
    files = [str(PROTO_ROOT / p) for p in proto_files()]
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
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
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        diffs = compare(Path(tmp) / PACKAGE_DIR, ROOT / PACKAGE_DIR)
    return [f"{what}: {PACKAGE_DIR / name}" for name, what in diffs.items()]


def update() -> list[str]:
    """Generate into a temp dir, then copy changed stubs into the repo and delete obsolete ones.

    Unchanged files are not touched. Returns what changed.
    """
    repo_dir = ROOT / PACKAGE_DIR
    repo_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh_dir = Path(tmp) / PACKAGE_DIR
        diffs = compare(fresh_dir, repo_dir)
        for name, what in diffs.items():
            if what == "obsolete":
                (repo_dir / name).unlink()
            else:
                shutil.copyfile(fresh_dir / name, repo_dir / name)
    return [f"{what} -> {'deleted' if what == 'obsolete' else 'written'}: {PACKAGE_DIR / name}"
            for name, what in diffs.items()]


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
        log.info("stubs in %s are up to date", PACKAGE_DIR)
        return 0
    changes = update()
    for change in changes:
        log.info("%s", change)
    log.info("stubs in %s are up to date (%d file(s) changed)", PACKAGE_DIR, len(changes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
