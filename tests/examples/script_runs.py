"""Runs several of the repository's scripts in one Python process, each as `python SCRIPT
ARGS...` would run it, and writes what each did as JSON.

    python tests/examples/script_runs.py OUT.json SCRIPT ARG... [-- SCRIPT ARG...]...

Starting Python and importing JAX costs each script run about as much as the run itself
(a --help, or a flag refused before the run), so tests/examples/test_benchmark_args.py
runs its scripts here, in one process per environment, and asserts each one's result.
Each run starts as a fresh `python SCRIPT` would: sys.path[0] is the script's folder
(this file's own folder is taken off sys.path), sys.argv is the script and its
arguments, and every module imported from this checkout by an earlier run is forgotten,
so each run imports the checkout's packages (or fails to) by itself; only third-party
packages (JAX, numpy) stay imported. A run's result is its exit status (0 when it
returned; an uncaught exception's traceback goes to its stderr and counts as 1), its
stdout and stderr, and the file kernels_pallas was imported from (None if it was not).
Under the key KERNELS_IMPORTABLE it also writes whether kernels_pallas imports with no
script's folder on sys.path (as an installed package), checked before the runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The checkout's top-level packages: forgotten between runs wherever they were imported
# from (an editable install may point at another checkout).
PACKAGES = {
    n for n in os.listdir(ROOT) if n.isidentifier() and os.path.isdir(os.path.join(ROOT, n))
}


def _from_checkout(name: str, module) -> bool:
    if name.partition(".")[0] in PACKAGES:
        return True
    path = getattr(module, "__file__", None)
    if path is None:
        path = next(iter(getattr(module, "__path__", None) or ()), None)
    return path is not None and os.path.abspath(path).startswith(ROOT + os.sep)


def run_script(script: str, args: list[str], base_path: list[str]) -> dict:
    """Runs `script` with `args` as `python script args` would, from a clean slate."""
    for name in [n for n, m in sys.modules.items() if _from_checkout(n, m)]:
        del sys.modules[name]
    sys.modules.pop("__main__", None)
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *base_path]
    sys.argv = [script, *args]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    kernels = sys.modules.get("kernels_pallas")
    return {
        "code": code,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "kernels_pallas": getattr(kernels, "__file__", None),
    }


KERNELS_IMPORTABLE = "kernels_pallas importable without a script"


def kernels_pallas_importable(base_path: list[str]) -> bool:
    sys.path[:] = base_path
    try:
        import kernels_pallas  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str]) -> int:
    out, *rest = argv
    runs, current = [], []
    for arg in [*rest, "--"]:
        if arg == "--":
            if current:
                runs.append(current)
            current = []
        else:
            current.append(arg)
    here = os.path.dirname(os.path.abspath(__file__))
    base_path = [p for p in sys.path[1:] if os.path.abspath(p or ".") != here]
    results: dict = {KERNELS_IMPORTABLE: kernels_pallas_importable(base_path)}
    results.update({" ".join(run): run_script(run[0], run[1:], base_path) for run in runs})
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
