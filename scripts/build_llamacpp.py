"""Build llama.cpp's benchmark tools once, for `specserve bench spec --peers llamacpp` (`make peers`).

The source is the `llama-cpp-python` source package from PyPI, which vendors llama.cpp (the only
registry this project's machines reach). Only the tools the benchmark runs are built:
`llama-lookup` (plain decoding with no draft, prompt-lookup decoding with one) and `llama-bench`
(its own tg/pp numbers). The binaries are cached under SPECSERVE_HOME/peers/llama.cpp-VERSION/bin,
so a second run builds nothing. It stays out of `make setup` and CI: 7-13 minutes on 2 cores.

    python scripts/build_llamacpp.py [--version 0.3.36] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.bench.llamacpp import DEFAULT_VERSION, TOOLS, peer_dir  # noqa: E402


def download(version: str, into: Path) -> Path:
    """The sdist of llama-cpp-python `version`, downloaded with pip (no wheel, no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(into)], check=True)
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise SystemExit(f"pip downloaded no llama_cpp_python-{version}.tar.gz into {into}")
    return found[0]


def build(source: Path, out: Path, jobs: int) -> None:
    """cmake + ninja for TOOLS only, native CPU flags, no network or GPU code; binaries into `out`."""
    build_dir = source / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON",
                    "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS], check=True)
    out.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        shutil.copy2(build_dir / "bin" / tool, out / tool)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python version whose llama.cpp to build")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    bin_dir = peer_dir(args.version) / "bin"
    if all((bin_dir / t).is_file() for t in TOOLS):
        print(f"llama.cpp tools already built: {bin_dir}")
        return
    with tempfile.TemporaryDirectory(prefix="llamacpp-") as tmp:
        sdist = download(args.version, Path(tmp))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = Path(tmp) / f"llama_cpp_python-{args.version}" / "vendor" / "llama.cpp"
        build(source, bin_dir, args.jobs)
    print(f"llama.cpp tools built: {bin_dir}")


if __name__ == "__main__":
    main()
