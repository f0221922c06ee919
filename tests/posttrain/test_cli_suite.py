"""The command line around `posttrain eval --suite` and user env modules (a user trial's findings): a malformed
suite or a domain that cannot be built is one `error:` line naming the suite file and the domain, exit code 2; the
current directory is importable for `module:Env-v0` ids, as under `python -m`; a flag that names a run given the
run's checkpoints/ folder names the folder to give; --distributed without a cluster or the JAX_* variables says
what to set."""
import os
import subprocess
import sys

import pytest

from posttrain import cli
from posttrain.recipes import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "posttrain")  # the console script pip installed
ARITH = {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1, "num_test": 20}}


@pytest.fixture
def eval_suite(tmp_path, monkeypatch, capsys):
    """run(domains) -> (exit code, stderr lines, suite path) of `posttrain eval --suite=<a suite of these domains>
    --checkpoint=RUN`, with the run's plan stubbed (the suite is parsed and resolved before any model load)."""
    monkeypatch.setattr(evaluate, "run_plan_of", lambda *a, **k: None)
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")

    def run(domains: dict):
        path = tmp_path / "my_suite.py"
        path.write_text(f"def get_suite():\n    return {{'name': 's', 'areas': {{'a': {{'domains': {domains!r}}}}}}}\n")
        code = cli.main(["posttrain", "eval", f"--suite={path}", f"--checkpoint={tmp_path / 'run'}"])
        return code, capsys.readouterr().err.strip().splitlines(), str(path)
    return run


@pytest.mark.parametrize("domains,named,message", [
    # C: settings of the wrong type (a scalar k is accepted: the typo domain beside it is the one named)
    ({"ar": {**ARITH, "n": 4, "k": 2.5, "temperature": 1.0}}, "ar", "k=2.5 must be an int >= 1 or a list of them"),
    ({"ar": {**ARITH, "kwargs": [1]}}, "ar", "kwargs=[1] must be a dict of env constructor kwargs"),
    ({"ar": {**ARITH, "config": "x"}}, "ar", "config='x' must be a dict"),
    ({"ar": {**ARITH, "tasks": "2"}}, "ar", "tasks='2' must be an int >= 1"),
    # D: ids, kwargs and values the env refuses, as training reports them
    ({"ok": {**ARITH, "n": 4, "k": 2, "temperature": 1.0}, "typo": {"env": "posttrain/Arithmetc-v0"}}, "typo",
     "id='posttrain/Arithmetc-v0' kwargs={'split': 'test'}: NameNotFound"),
    ({"ar": {"env": "posttrain/Arithmetic-v0", "kwargs": {"digitz": 1}}}, "ar",
     "unexpected keyword argument 'digitz'"),
    ({"ar": {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1}, "tasks": 2}}, "ar",
     "ArithmeticTasks: num_test must be in [1, 50], got 200"),
    ({"reasoning_gym/not_a_dataset": {}}, "reasoning_gym/not_a_dataset", "unknown domain"),
    # A: an env module of your own that is not there is an error, not a skipped domain
    ({"nope": {"env": "no_such_envs_zz:Nope-v0"}, "ok": ARITH}, "nope", "no module named 'no_such_envs_zz'"),
    # E: pass@k needs n >= k, not 2k
    ({"ar": {**ARITH, "n": 4, "k": [5], "temperature": 1.0}}, "ar", "pass@k needs n >= k samples per task"),
])
def test_a_bad_suite_domain_is_one_line_naming_the_file_and_domain_exit_2(eval_suite, domains, named, message):
    code, err, path = eval_suite(domains)
    assert code == 2 and err and err[-1].startswith(f"error: {path}: domain {named!r}: "), err
    assert message in err[-1] and not any(line.startswith("Traceback") for line in err), err


def test_the_current_directory_is_importable(eval_suite, tmp_path, monkeypatch):
    """B: a module in the directory the command runs in is found (a typo inside it is then the error named), as
    under `python -m`; the `posttrain` script's own sys.path does not hold that directory."""
    (tmp_path / "cwd_typo_envs_zz.py").write_text("import gymnasium\n\nx = undefined_name\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    code, err, path = eval_suite({"mine": {"env": "cwd_typo_envs_zz:Mine-v0"}})
    assert code == 2 and str(tmp_path) in sys.path
    assert err[-1] == (f"error: {path}: domain 'mine': env 'cwd_typo_envs_zz:Mine-v0': importing module "
                       f"'cwd_typo_envs_zz' raised NameError: name 'undefined_name' is not defined "
                       f"({tmp_path / 'cwd_typo_envs_zz.py'}:3)")


@pytest.mark.skipif(not os.path.exists(SCRIPT), reason="no posttrain console script in this environment")
def test_the_console_script_imports_env_modules_from_the_current_directory(tmp_path):
    """B end to end: `posttrain train` run where my_envs.py sits builds its env (whose error is then the one
    named: the module was imported) before any model load; nothing is created."""
    (tmp_path / "cwd_envs_zz.py").write_text("import gymnasium\n\n\ndef make(**kwargs):\n    raise ValueError("
                                             "'built from the current directory')\n\n\n"
                                             "gymnasium.register('CwdEnv-v0', entry_point=make)\n")
    (tmp_path / "cfg.py").write_text(
        "from posttrain.config import env_spec\nfrom posttrain.config.tiny import tiny_base\n\n\ndef get_config():\n"
        "    c = tiny_base('tiny-dense', workdir='w')\n    c.env.train = {'mine': env_spec('cwd_envs_zz:CwdEnv-v0')}\n"
        "    c.train.preflight_prompt_len = 0\n    return c\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([SCRIPT, "train", "--config=cfg.py", "--noprogress"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**env, "POSTTRAIN_XLA_CACHE": "0", "JAX_PLATFORMS": "cpu"})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines[-1] == ("error: env.train.mine: id='cwd_envs_zz:CwdEnv-v0' kwargs={}: "
                                                 "ValueError: built from the current directory"), res.stderr[-2000:]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args,flag,given", [
    (("eval", "--suite=configs/eval/tiny.py", "--checkpoint={run}/checkpoints"), "--checkpoint", "{run}/checkpoints"),
    (("eval", "--config=configs/tiny.py", "--checkpoint={run}/checkpoints/"), "--checkpoint", "{run}/checkpoints/"),
    (("sample", "--checkpoint={run}/checkpoints/2"), "--checkpoint", "{run}/checkpoints/2"),
    (("convert", "--checkpoint={run}/checkpoints", "--out={tmp}/hf"), "--checkpoint", "{run}/checkpoints"),
    (("eval", "--suite=configs/eval/tiny.py", "--checkpoint={run}", "--baseline={run}/checkpoints"), "--baseline",
     "{run}/checkpoints"),
    (("sft", "--from_archive={run},{run}/checkpoints"), "--from_archive", "{run}/checkpoints"),
    (("status", "--workdir={run}/checkpoints"), "--workdir", "{run}/checkpoints"),
])
def test_a_run_flag_given_the_runs_checkpoints_folder_names_the_run_folder(tmp_path, capsys, monkeypatch, args,
                                                                          flag, given):
    """I: the checkpoints/ folder (or a step folder in it) instead of the run: one line naming the run folder,
    exit 2, before anything is read or created."""
    run = tmp_path / "tiny"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")
    monkeypatch.chdir(ROOT)
    code = cli.main(["posttrain", *[a.format(run=run, tmp=tmp_path) for a in args]])
    err = capsys.readouterr().err.strip().splitlines()
    given = given.format(run=run)
    what = "a checkpoint step folder" if given.endswith("/2") else "the checkpoints/ folder"
    assert code == 2 and err[-1] == (f"error: {flag}={given} is {what} of the run {run}; {flag} names the run's own "
                                     f"folder (the one holding config.json): {flag}={run}"), err
    assert not (tmp_path / "hf").exists()


def test_distributed_without_a_cluster_or_its_variables_says_what_to_set(tmp_path):
    """H: --distributed where JAX detects no cluster and no JAX_* variable is set: one line naming the variables
    (it was jax's ValueError traceback 'coordinator_address should be defined.'). A process of its own: JAX's
    check runs only before any JAX computation."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS",
                                                                    "SLURM_", "OMPI_", "KUBERNETES_"))}
    res = subprocess.run([sys.executable, "-m", "posttrain.cli", "status", f"--workdir={tmp_path}", "--distributed"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**env, "POSTTRAIN_XLA_CACHE": "0", "JAX_PLATFORMS": "cpu"})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines[-1] == (
        "error: distributed mode (--distributed or POSTTRAIN_DISTRIBUTED=1): coordinator_address should be defined; "
        "no cluster detected (JAX finds its peers by itself on Cloud TPU VMs, SLURM (srun), Open MPI (mpirun) and "
        "Kubernetes): set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID in every process, e.g. "
        "JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 on the first host (launch/ has "
        "TPU pod, SLURM and one-machine scripts)"), res.stderr[-2000:]
    assert not any(x.startswith("Traceback") for x in lines)


@pytest.mark.parametrize("variables,line", [
    ({"JAX_NUM_PROCESSES": "two"}, "error: JAX_NUM_PROCESSES='two': expected an integer >= 0"),
    ({"JAX_PROCESS_ID": "-1"}, "error: JAX_PROCESS_ID='-1': expected an integer >= 0"),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1"},
     "error: JAX_COORDINATOR_ADDRESS='10.0.0.1': expected host:port (the address of process 0)"),
])
def test_a_malformed_distributed_variable_is_one_line_naming_it(tmp_path, capsys, monkeypatch, variables, line):
    """H: refused before JAX is called (in this process: nothing of JAX's distributed state is touched)."""
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in variables.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")
    assert cli.main(["posttrain", "status", f"--workdir={tmp_path}", "--distributed"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == line
