"""`python -m bench`: run every benchmark; `python -m bench NAME [ARGS...]`: run one.

A benchmark is any module `bench/bench_*.py` with a `main()` function (NAME is `worker`,
`bench_worker` or `bench_worker.py`). With one NAME, the ARGS after it go to that benchmark's own
options (`python -m bench worker --json out.json`).

Each benchmark runs in a fresh interpreter, one after the other: a benchmark that leaves a server,
threads or a loaded vLLM behind would otherwise skew the next one's figures on a 2-core machine, and
one that crashes the interpreter (torch, a native extension) must not stop the others. A failing
benchmark is reported and the run goes on; the exit status is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import pkgutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import ROOT, exit_on_sigterm

BENCH_DIR = Path(__file__).resolve().parent

# Imports the module and calls its main() with the given arguments as sys.argv, so a main() that
# parses sys.argv itself and one that takes argv both work; a return value (or SystemExit) of
# None or 0 is success.
_RUNNER = """
import importlib, sys
name = sys.argv[1]
sys.argv = [f"python -m bench.{name}", *sys.argv[2:]]
rc = importlib.import_module(f"bench.{name}").main()
sys.exit(0 if rc is None else rc)
"""


def discover() -> list[str]:
    """Module names of every benchmark, sorted: `bench_*.py` files in this folder."""
    return sorted(m.name for m in pkgutil.iter_modules([str(BENCH_DIR)])
                  if m.name.startswith("bench_") and not m.ispkg)


def resolve(name: str, available: Sequence[str]) -> str:
    """Accepts `worker`, `bench_worker` and `bench_worker.py` (and a path to it)."""
    stem = Path(name).name.removesuffix(".py")
    module = stem if stem.startswith("bench_") else f"bench_{stem}"
    if module not in available:
        raise SystemExit(f"no benchmark {name!r}; available: {', '.join(m.removeprefix('bench_') for m in available)}")
    return module


def run_one(module: str, args: Sequence[str]) -> int:
    print(f"=== {module} ===", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER, module, *args], cwd=ROOT)
    try:
        rc = proc.wait()
    except BaseException:        # SIGTERM or Ctrl-C here: the benchmark stops its servers, then we go
        proc.terminate()
        proc.wait(60)
        raise
    status = "ok" if rc == 0 else f"FAILED (exit {rc})"
    print(f"=== {module}: {status} in {time.monotonic() - t0:.1f} s ===\n", flush=True)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    available = discover()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", help=f"one benchmark ({', '.join(available) or 'none found'})")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options for that benchmark")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    opts = parser.parse_args(argv)
    if opts.list:
        print("\n".join(available))
        return 0
    if opts.name:
        return 0 if run_one(resolve(opts.name, available), opts.args) == 0 else 1
    if not available:
        print("no benchmarks found in bench/", file=sys.stderr)
        return 1
    failed = [m for m in available if run_one(m, []) != 0]
    if failed:
        print(f"{len(failed)} of {len(available)} benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {len(available)} benchmarks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
