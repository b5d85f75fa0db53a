"""Mutation testing of Kiln's test suite: how many planted bugs do the tests catch?

    python bench/mutation.py formulas              # every mutant of the C++ formula tables
    python bench/mutation.py formulas --every 3    # a deterministic third of them (quicker)
    python bench/mutation.py passes                # mutmut over kiln/passes (tests/passes)
    python bench/mutation.py passes --every 8 --offset 4 --jobs 2   # one eighth of those
    python bench/mutation.py passes --names A,B    # chosen mutmut mutants (e.g. survivors)
    python bench/mutation.py planted               # the planted bugs of issue 18

``formulas`` perturbs the generated-code formula strings of kiln/codegen/cpp/ops.py (the FORMULAS
table and the helper functions of PRELUDE): every numeric constant (x2, or 1 for 0) and every
binary operator (+ <-> -, * <-> /, < <-> <=, > <-> >=, == <-> !=, && <-> ||).  Many mutants run
in one worker process (bench/_mutation_worker.py): it swaps the mutated table and PRELUDE in,
drops the compiled graphs and calls the CI test functions of tests/kernels/test_formulas.py
(the cases that use the mutated formula in lazy mode first, then every case in both modes); a
survivor is then run by pytest over the other tests/kernels files in a scratch copy of the tree
(``--no-confirm`` skips that).  ``passes`` runs mutmut over kiln/passes with tests/passes in a
scratch copy (see cmd_passes for the settings that keep cached graphs from hiding the passes).
Each prints a report and, with ``--report FILE``, writes it as Markdown (docs/mutation.md).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = Path("kiln/codegen/cpp/ops.py")
sys.path.insert(0, str(ROOT))

_OPS = [(" + ", " - "), (" - ", " + "), (" * ", " / "), (" / ", " * "), (" <= ", " < "),
        (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "), (" != ", " == "),
        (" && ", " || "), (" || ", " && ")]  # fmt: skip
_NUM = re.compile(r"(?<![\w.])(\d+\.\d*(?:e[-+]?\d+)?|\d+(?:e[-+]?\d+)?)(f|LL)?(?![\w.])")


@dataclass
class Mutant:
    index: int
    line: int  # 1-based line in ops.py
    where: str  # the FORMULAS key or helper the line belongs to
    before: str
    after: str
    source: str  # the whole mutated ops.py


def _regions(text: str) -> list[tuple[int, int]]:
    """Character ranges of the formula code: the formula functions and table, and PRELUDE."""
    start = text.index("def _cast(")
    end = text.index("# Helpers every generated translation unit")
    p0 = text.index("static inline float exp(float x)")
    p1 = text.index('"""', p0)
    return [(start, end), (p0, p1)]


def _where(text: str, pos: int) -> str:
    line = text[:pos].rsplit("\n", 1)[0]
    keys = re.findall(r'^\s*"([\w.:]+)": ', text[:pos], re.M)
    funcs = re.findall(r"^(?:def (\w+)|static inline \w+ (\w+)\()", text[:pos], re.M)
    last_key = keys[-1] if keys else ""
    last_fn = next((a or b for a, b in reversed(funcs)), "")
    if "FORMULAS: dict" in text[:pos] and pos < text.index("# Helpers every"):
        return last_key or last_fn
    return last_fn or line.strip()


def formula_mutants() -> list[Mutant]:
    text = (ROOT / OPS).read_text()
    regions = _regions(text)
    strings: list[tuple[int, int]] = []  # absolute ranges of string tokens in the regions
    offsets = [0]
    for ln in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(ln))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING and tok.string.startswith('"""'):
            continue  # a docstring: not generated code (PRELUDE is an r-string)
        if tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)):
            a = offsets[tok.start[0] - 1] + tok.start[1]
            b = offsets[tok.end[0] - 1] + tok.end[1]
            strings.append((a, b))
    out: list[Mutant] = []

    def add(pos: int, old: str, new: str) -> None:
        src = text[:pos] + new + text[pos + len(old) :]
        line = text.count("\n", 0, pos) + 1
        snippet = text.splitlines()[line - 1].strip()
        out.append(
            Mutant(
                len(out), line, _where(text, pos), snippet, f"{old.strip()} -> {new.strip()}", src
            )
        )

    for a, b in strings:
        for r0, r1 in regions:
            lo, hi = max(a, r0), min(b, r1)
            if lo >= hi:
                continue
            seg = text[lo:hi]
            if text[a:b].lstrip("rRbB").startswith(("f", "F")):  # leave {replacement fields} be
                seg = re.sub(r"\{[^{}]*\}", lambda m: " " * len(m.group(0)), seg)
            for old, new in _OPS:
                for m in re.finditer(re.escape(old), seg):
                    add(lo + m.start(), old, new)
            for m in _NUM.finditer(seg):
                num, suffix = m.group(1), m.group(2) or ""
                v = float(num)
                if "e" in num or "." in num:
                    repl = repr(v * 2 if v else 1.0)
                else:
                    repl = str(int(v) * 2 if v else 1)
                if suffix == "f" and "." not in repl and "e" not in repl:
                    repl += ".0"
                add(lo + m.start(), m.group(0), repl + suffix)
    return out


# formula helpers -> the FORMULAS keys that use them (others: every case runs)
HELPERS = {
    "_gelu": ["gelu.default"],
    "_gelu_backward": ["gelu_backward.default"],
    "kiln_gelu_bwd": ["gelu_backward.default", "gelu.default"],
    "kiln_gelu_tanh_bwd": ["gelu_backward.default", "gelu.default"],
    "kiln_silu_bwd": ["silu_backward.default", "silu.default"],
    "_pow_tensor_scalar": ["pow.Tensor_Scalar"],
    "_lerp": ["lerp.Scalar", "lerp.Tensor"],
    "_addc": ["addcmul.default", "addcdiv.default"],
    "_where": ["where.self"],
    "_masked_fill": ["masked_fill.Scalar", "masked_fill.Tensor"],
    "_fma": ["opaque.prims::fma.default"],
    "_clamp": ["clamp.default"],
    # PRELUDE's km:: helpers: first the cases of their own op (a mutant that survives those runs
    # against every case anyway)
    "exp": ["exp.default"],
    "erf": ["erf.default"],
    "abs": ["abs.default"],
    "fma": ["opaque.prims::fma.default", "add.Tensor"],
}


def cases_for(mut: Mutant) -> list[str]:
    """Kernel test cases that run the mutated formula (all cases for shared helpers)."""
    sys.path.insert(0, str(ROOT / "tests" / "kernels"))
    from _cases import CASES, KERNEL_CASES

    keys = HELPERS.get(mut.where, [mut.where])
    hits = [c.name for c in CASES + KERNEL_CASES if set(keys) & set(c.formulas)]
    if mut.where in ("kiln_gelu_bwd", "kiln_gelu_tanh_bwd", "kiln_silu_bwd", "_gelu"):
        hits += [c.name for c in KERNEL_CASES if c.grad_inputs is not None]
    return hits or [c.name for c in CASES + KERNEL_CASES]


def _scratch() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kiln_mut_"))
    for part in ("kiln", "tests", "pyproject.toml"):
        s = ROOT / part
        (shutil.copytree if s.is_dir() else shutil.copy)(s, d / part)
    return d


def run_tests(tree: Path, args: list[str], env_extra: dict, timeout: int) -> tuple[bool, str]:
    """True when the tests pass (the mutant survives)."""
    env = dict(os.environ, PYTHONPATH=str(tree), **env_extra)
    env["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln_mut_cache_")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timeout (counted as killed)"
    if "error during collection" in p.stdout or "no tests ran" in p.stdout:
        raise RuntimeError(f"the tests did not run: {p.stdout[-2000:]}")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", p.stdout, re.M)
    tail = (p.stdout.strip() or p.stderr.strip() or f"exit {p.returncode}").splitlines()[-1]
    return p.returncode == 0, (failed[0] if failed else tail)


class Worker:
    """bench/_mutation_worker.py in a subprocess: many mutants per process (torch, Kiln and the
    eager reference results are loaded once).  A worker that dies (a mutant that crashes the
    process, e.g. SIGFPE) or runs past the timeout fails the run (as it would fail CI's pytest)
    and is replaced."""

    def __init__(self, timeout: int) -> None:
        self.timeout = timeout
        self.cache = tempfile.mkdtemp(prefix="kiln_mut_cache_")
        self.p: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT), KILN_CACHE_DIR=self.cache)
        return subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "_mutation_worker.py")],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )  # fmt: skip

    def run(self, index: int, cases: list[str], modes: list[str]) -> tuple[bool, str]:
        """True when every test passes (the mutant survives)."""
        if self.p is None or self.p.poll() is not None:
            self.p = self._start()
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps({"index": index, "cases": cases, "modes": modes}) + "\n")
        self.p.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.p.stdout], [], [], max(left, 0))
            if not ready:
                self.close()
                return False, f"timeout after {self.timeout} s (counted as killed)"
            line = self.p.stdout.readline()
            if not line:  # the process died
                rc = self.p.wait()
                self.p = None
                return False, f"the test process died (exit {rc}: signal {-rc})" if rc < 0 else (
                    f"the test process exited ({rc})"
                )
            if line.startswith("@@MUT "):
                r = json.loads(line[6:])
                if r["why"].startswith("HARNESS ERROR"):
                    raise RuntimeError(f"mutant {index}: {r['why']}")
                return r["ok"], r["why"]

    def close(self) -> None:
        if self.p is not None:
            self.p.kill()
            self.p.wait()
            self.p = None


def cmd_formulas(a: argparse.Namespace) -> list[str]:
    muts = formula_mutants()[:: a.every]
    if a.only:
        muts = [m for m in muts if m.where in a.only.split(",")]
    if a.index:
        want = {int(i) for i in a.index.split(",")}
        muts = [m for m in muts if m.index in want]
    worker = Worker(a.timeout)
    killed, survivors = 0, []
    t0 = time.perf_counter()
    ok, why = worker.run(-1, [], ["lazy", "compile"])
    if not ok:
        raise RuntimeError(f"the kernel tests fail on the unmutated tree: {why}")
    for k, m in enumerate(muts):
        ok, why = worker.run(m.index, cases_for(m), ["lazy"])
        if ok:  # survived its cases in lazy mode: every case, both modes
            ok, why = worker.run(m.index, [], ["lazy", "compile"])
        if ok and a.confirm:  # still alive: the real pytest in a scratch copy, more CI tests
            ok, why = confirm(m, a.timeout * 4)
        verdict = "SURVIVED" if ok else "killed by " + why
        print(f"[{m.index}] line {m.line} {m.where}: {m.after}: {verdict}", flush=True)
        if ok:
            survivors.append(m)
        else:
            killed += 1
        if (k + 1) % 50 == 0:  # no state left behind by earlier mutants: the tree still passes
            ok, why = worker.run(-1, [], ["lazy", "compile"])
            if not ok:
                raise RuntimeError(f"sanity run failed after mutant {m.index}: {why}")
    worker.close()
    n = len(muts)
    sel = f" --every {a.every}" if a.every > 1 else ""
    sel += f" --only {a.only}" if a.only else ""
    lines = [
        f"## Formula tables ({OPS})",
        "",
        f"`python bench/mutation.py formulas{sel}`: {n} mutants, {killed} killed, "
        f"{len(survivors)} survived: score {100 * killed / max(n, 1):.1f}% "
        f"({time.perf_counter() - t0:.0f} s).",
        "",
    ]
    if survivors:
        lines += ["| # | line | formula | mutation | code |", "|---|---|---|---|---|"]
        lines += [
            f"| {m.index} | {m.line} | {m.where} | `{m.after}` | `{m.before}` |" for m in survivors
        ]
    return lines


def confirm(m: Mutant, timeout: int) -> tuple[bool, str]:
    """A survivor of the worker (which ran tests/kernels/test_formulas.py), run by pytest over the
    other test files of tests/kernels (and, with ``KILN_MUTATION_CONFIRM`` naming more test paths,
    those too) in a scratch copy of the tree holding the mutated ops.py."""
    tests = sorted(
        str(f.relative_to(ROOT))
        for f in (ROOT / "tests" / "kernels").glob("test_*.py")
        if f.name != "test_formulas.py"
    )
    tests += os.environ.get("KILN_MUTATION_CONFIRM", "").split()
    tree = _scratch()
    try:
        (tree / OPS).write_text(m.source)
        return run_tests(tree, tests, {}, timeout)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


PLANTED = {
    "gelu_tanh_bwd without its factor 3": (OPS, "(1.0f + 3.0f * c * x2)", "(1.0f + c * x2)"),
    "sigmoid_backward without * y": (
        OPS,
        """f"({_cast(a[0], o)} * ((({o})1) - {_cast(a[1], o)}) * {_cast(a[1], o)})\"""",
        """f"({_cast(a[0], o)} * ((({o})1) - {_cast(a[1], o)}))\"""",
    ),
    "simplify.number without its all-elements-equal check": (
        Path("kiln/passes/simplify.py"),
        "        if not bool((flat == flat[0]).all()):\n            return None\n",
        "",
    ),
}
PLANTED_TESTS = {
    "gelu_tanh_bwd without its factor 3": ["tests/kernels"],
    "sigmoid_backward without * y": ["tests/kernels"],
    "simplify.number without its all-elements-equal check": ["tests/passes/test_simplify.py"],
}


def cmd_planted(a: argparse.Namespace) -> list[str]:
    lines = ["## Planted bugs (issue 18)", "", "| bug | caught by |", "|---|---|"]
    for name, (path, old, new) in PLANTED.items():
        tree = _scratch()
        text = (tree / path).read_text()
        assert old in text, f"planted bug {name!r}: code not found"
        (tree / path).write_text(text.replace(old, new, 1))
        ok, why = run_tests(tree, PLANTED_TESTS[name], {}, a.timeout * 4)
        shutil.rmtree(tree, ignore_errors=True)
        print(f"{name}: {'NOT CAUGHT' if ok else 'caught by ' + why}", flush=True)
        lines.append(f"| {name} | {'NOT CAUGHT' if ok else why} |")
    return lines


PASSES_MUTMUT = """[tool.mutmut]
source_paths = ["kiln/"]
only_mutate = [{files}]
pytest_add_cli_args_test_selection = ["tests/passes"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x"]
process_isolation = "forkserver"
"""


# Only in the scratch copy of a passes run: each mutant's test process is forked from one that may
# already have compiled graphs (with fork isolation: the statistics run over the whole suite), and
# the compiled graphs and Dynamo frames it holds would be served without the passes running.
PASSES_CONFTEST = """
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    from kiln.runtime.compiler import clear_memory_cache

    clear_memory_cache()
    torch._dynamo.reset()
    yield
"""

_GENERATE = """
import os
from pathlib import Path
from mutmut.__main__ import (copy_also_copy_files, copy_src_dir, create_mutants,
    set_mutant_under_test, setup_source_paths, store_lines_covered_by_tests)
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); store_lines_covered_by_tests()
create_mutants(2)
"""


def _mutant_names(tree: Path) -> list[str]:
    names = []
    for meta in sorted((tree / "mutants").rglob("*.py.meta")):
        names += list(json.loads(meta.read_text())["exit_code_by_key"])
    return sorted(names)


def cmd_passes(a: argparse.Namespace) -> list[str]:
    """mutmut over kiln/passes with tests/passes, in a scratch copy whose pyproject.toml names
    those files (the repository's own [tool.mutmut] section is the cluster's)."""
    t0 = time.perf_counter()
    tree = _scratch()
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "kiln" / "passes").glob("*.py"))
    py = (tree / "pyproject.toml").read_text()
    py = re.sub(r"\[tool\.mutmut\][^\[]*", "", py)
    py += "\n" + PASSES_MUTMUT.format(files=", ".join(f'"{f}"' for f in files))
    (tree / "pyproject.toml").write_text(py)
    (tree / "tests" / "passes" / "conftest.py").write_text(PASSES_CONFTEST)
    # No persistent graph cache: mutmut keeps every mutant in one trampolined source file, so the
    # cache key (which hashes the passes' source) is the same for all of them, and a graph
    # optimized under one mutant (or none) would be served to the next without the passes running.
    env = dict(
        os.environ, KILN_CACHE_DIR=tempfile.mkdtemp(prefix="kiln_mut_cache_"), KILN_DISK_CACHE="0"
    )
    names: list[str] = []
    if a.every > 1 or a.names:  # a deterministic sample: every Nth mutant name (from --offset)
        subprocess.run([sys.executable, "-c", _GENERATE], cwd=tree, env=env, check=True)
        names = _mutant_names(tree)[a.offset :: a.every]
        if a.names:  # chosen mutants (e.g. the survivors of an earlier run)
            want = set(a.names.split(","))
            missing = want - set(_mutant_names(tree))
            if missing:
                raise SystemExit(f"no such mutants: {sorted(missing)} (see `mutmut results`)")
            names = [m for m in names if m in want]
        print(f"sample: {len(names)} mutants", flush=True)
    jobs = ["--max-children", str(a.jobs)] if a.jobs else []
    p = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", *jobs, *names], cwd=tree, env=env, text=True
    )
    r = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=tree, capture_output=True, text=True, env=env,
    )  # fmt: skip
    status = re.findall(r"^\s*(\S+): (\w[\w ]*)$", r.stdout, re.M)
    if names:
        want = set(names)
        status = [(m, s) for m, s in status if m in want]
    counts: dict[str, int] = {}
    for _, s in status:
        counts[s] = counts.get(s, 0) + 1
    n = sum(counts.values())
    # A timeout is not counted as a kill (nor as a survivor): with mutmut's default fork
    # isolation, test processes forked from the one that ran the statistics hung on torch's
    # thread-pool locks; the fork server (PASSES_MUTMUT) forks from a process that only collected
    # the tests.  Rerun timeouts with --names.  Score = killed / (killed + survived).
    killed = counts.get("killed", 0)
    decided = killed + counts.get("survived", 0)
    sel = f" --every {a.every}" if a.every > 1 else ""
    sel += f" --offset {a.offset}" if a.offset else ""
    sel += f" --names <{len(a.names.split(','))} names>" if a.names else ""
    lines = [
        "## kiln/passes (mutmut)",
        "",
        f"`python bench/mutation.py passes{sel}` (exit {p.returncode}): {n} mutants, {counts}; "
        f"score {100 * killed / max(decided, 1):.1f}% of the decided ones "
        f"({time.perf_counter() - t0:.0f} s); "
        f"scratch tree {tree} (`python -m mutmut show NAME` there).",
        "",
    ]
    lines += [f"- `{m}`: {s}" for m, s in status if s not in ("killed", "timeout")]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["formulas", "passes", "planted", "list"])
    ap.add_argument("--every", type=int, default=1, help="run every Nth formula mutant")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test run")
    ap.add_argument("--report", default="", help="write the report (Markdown) here")
    ap.add_argument("--only", default="", help="formulas: only mutants of these (comma-separated)")
    ap.add_argument("--index", default="", help="formulas: only these mutant numbers")
    ap.add_argument("--names", default="", help="passes: only these mutmut names (comma-separated)")
    ap.add_argument("--offset", type=int, default=0, help="passes: the sample starts here")
    ap.add_argument("--jobs", type=int, default=0, help="passes: mutmut's --max-children")
    ap.add_argument(
        "--no-confirm", dest="confirm", action="store_false",
        help="formulas: skip rerunning survivors by pytest over the other tests/kernels files",
    )  # fmt: skip
    a = ap.parse_args()
    if a.what == "list":
        for m in formula_mutants():
            print(m.index, m.line, m.where, m.after, "|", m.before)
        return
    lines = {"formulas": cmd_formulas, "passes": cmd_passes, "planted": cmd_planted}[a.what](a)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.report:
        Path(a.report).write_text(text)


if __name__ == "__main__":
    main()
