"""The command lines share one error wrapper and are console scripts; metric sinks are chosen in config."""
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import jax
import pytest
import xla_test_flags
from conftest import SMALL

from jaxtrain import config as cfglib
from jaxtrain.analysis import explain as explain_cli
from jaxtrain.analysis import plan as plan_cli
from jaxtrain.analysis.explain import explain
from jaxtrain.cli import export as export_cli
from jaxtrain.cli import prepare as prepare_cli
from jaxtrain.cli import train as train_cli
from jaxtrain.errors import ConfigError
from jaxtrain.examples import digits
from jaxtrain.train import fit

UNKNOWN = "error: unknown config key 'train.stpes'; did you mean 'train.steps'?\n"


@pytest.mark.parametrize("main,argv", [
    (train_cli.main, ["train.stpes=1"]),
    (plan_cli.main, ["--devices", "2", "train.stpes=1"]),
    (explain_cli.main, ["train.stpes=1"]),
    (export_cli.main, ["--import", "somewhere", "train.stpes=1"]),
    (prepare_cli.main, ["--out", "somewhere", "train.stpes=1"]),
    (digits.main, ["train.stpes=1"]),
])
def test_every_command_names_a_bad_key_and_exits_2(main, argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == UNKNOWN


def test_explain_takes_one_rule_set_and_reads_the_memory_budget(capsys):
    assert explain_cli.main(["--rules", "dp,fsdp"]) == 2
    assert capsys.readouterr().err == ("error: --rules: explain shows one rule set, got 'dp,fsdp' (compare several "
                                       "with python -m jaxtrain.plan --rules dp,fsdp)\n")
    cfg = cfglib.load(None, [*SMALL, "mesh.data=2", "sharding.rules=dp"])
    text = explain(cfg, jax.devices()[:2], vocab=256, budget=1024)
    over = [line for line in text.splitlines() if line.startswith("device peak ")]
    assert len(over) == 1 and over[0].endswith(": OVER --device-memory 1.0 KiB"), over


def test_console_scripts_are_registered():
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts") if e.name.startswith("jaxtrain")}
    assert scripts == {"jaxtrain-train": "jaxtrain.cli.train:main", "jaxtrain-export": "jaxtrain.cli.export:main",
                       "jaxtrain-plan": "jaxtrain.analysis.plan:main",
                       "jaxtrain-explain": "jaxtrain.analysis.explain:main",
                       "jaxtrain-prepare": "jaxtrain.cli.prepare:main",
                       "jaxtrain-report": "jaxtrain.analysis.report:main",
                       "jaxtrain-digits": "jaxtrain.examples.digits:main", "jaxtrain-launch": "jaxtrain.launch:main"}


def test_metrics_sinks_choose_where_rows_go(small_cfg, capsys):
    one = jax.devices()[:1]
    quiet_console = fit(small_cfg("train.steps=2", "mesh.data=1", "checkpoint.enabled=false",
                                  "metrics.sinks=[jsonl]", run_dir="jsonl"), devices=one, quiet=True)
    out = capsys.readouterr().out
    assert "step      1 | loss" not in out and "validation loss " in out
    assert (quiet_console.run_dir / "metrics.jsonl").read_text().count('"loss"') == 2
    console_only = fit(small_cfg("train.steps=2", "mesh.data=1", "checkpoint.enabled=false",
                                 "metrics.sinks=[console]", run_dir="console"), devices=one, quiet=True)
    assert "step      2 | loss " in capsys.readouterr().out
    assert not (console_only.run_dir / "metrics.jsonl").exists()
    with pytest.raises(ConfigError) as e:
        small_cfg("metrics.sinks=[console, neptune]")
    assert str(e.value) == "metrics.sinks: unknown sink 'neptune' (known: console, jsonl, tensorboard, mlflow, wandb)"


def test_sink_names_in_the_schema_are_the_sinks_there_are():
    from jaxtrain.config.schema import SINKS as NAMES
    from jaxtrain.metrics.sinks import SINKS
    assert tuple(SINKS) == NAMES


def test_plan_names_a_config_it_cannot_build_once(capsys):
    assert plan_cli.main(["--config", "digits_mlp", "--devices", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: model.family: 'custom' is a model built in Python")
    assert plan_cli.main(["--devices", "2", "--rules", ","]) == 2
    assert capsys.readouterr().err == "error: --rules: no rule set named (e.g. --rules dp,fsdp)\n"


@pytest.mark.parametrize("gc_every,automatic", [("10", False), ("0", True)])
def test_train_runs_with_automatic_gc_off_unless_gc_every_is_0(monkeypatch, tmp_path, gc_every, automatic):
    import gc

    import jaxtrain.train as train_pkg
    seen = []
    monkeypatch.setattr(train_pkg, "fit", lambda cfg: seen.append((gc.isenabled(), cfg.train.gc_every)))
    assert gc.isenabled()
    assert train_cli.main([f"run.dir={tmp_path}", f"train.gc_every={gc_every}"]) == 0
    assert seen == [(automatic, int(gc_every))]
    assert gc.isenabled()  # called in-process: the collector is left as it was found


def test_a_single_process_run_dispatches_its_cpu_programs_inline(monkeypatch, tmp_path):
    import jaxtrain.train as train_pkg
    from jaxtrain.kernels.cpu import dispatch as cpu_dispatch
    calls = []
    monkeypatch.setattr(train_pkg, "fit", lambda cfg: calls.append("fit"))
    monkeypatch.setattr(cpu_dispatch, "run_inline", lambda: calls.append("inline"))  # not this process's JAX
    assert train_cli.main([f"run.dir={tmp_path}"]) == 0
    assert calls == ["inline", "fit"]


@pytest.mark.parametrize("command", [["jaxtrain.train", "train.steps=1", "run.dir={r}"],
                                     ["jaxtrain.export", "{r}", "{r}/out"]])  # (plan and explain run on CPU devices)
def test_a_platform_jax_cannot_start_is_bad_input_named_by_its_variable(tmp_path, command):
    env = {**os.environ, "JAX_PLATFORMS": "nonesuch"}
    args = [a.format(r=tmp_path / "r") for a in command]
    done = subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: JAX_PLATFORMS='nonesuch': JAX could not start it: Unable to initialize backend 'nonesuch': ")
    assert not (tmp_path / "r").exists()  # nothing written


def test_a_second_sigint_stops_with_130_and_a_line_not_a_traceback(capsys):
    from jaxtrain.cli.common import cli

    def body():
        raise KeyboardInterrupt
    assert cli(body) == 130
    assert capsys.readouterr().err == ("interrupted (a second SIGINT): stopped at once; committed checkpoints are "
                                       "intact\n")


def test_a_bad_xla_flags_opt_out_is_exit_2_before_anything_runs(monkeypatch, tmp_path, capsys):
    import jaxtrain.train as train_pkg
    calls = []
    monkeypatch.setattr(train_pkg, "fit", lambda cfg: calls.append("fit"))
    monkeypatch.setenv("JAXTRAIN_XLA_CPU_FLAGS", "false")
    assert train_cli.main([f"run.dir={tmp_path}"]) == 2 and calls == []
    assert capsys.readouterr().err.strip().endswith(
        "error: JAXTRAIN_XLA_CPU_FLAGS='false': expected 1 (add jaxtrain's default XLA flags, the default) or 0 "
        "(add none)")


def test_no_persistent_compile_cache_over_several_cpu_devices(monkeypatch):
    """XLA:CPU runs a cached program's collectives unordered (a deadlock: see enable_compilation_cache
    and tests/integration/test_pipeline.py); one CPU device, or GPUs, keep the cache."""
    from types import SimpleNamespace

    import jax

    from jaxtrain.cli.common import enable_compilation_cache
    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {k: jax.config.values[k] for k in keys}
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    cpu, gpu = SimpleNamespace(platform="cpu"), SimpleNamespace(platform="gpu")
    try:
        jax.config.update("jax_compilation_cache_dir", "/somewhere")  # as JAX reads the variable
        assert enable_compilation_cache([cpu, cpu]) is False
        assert jax.config.values["jax_enable_compilation_cache"] is False
        assert jax.config.values["jax_compilation_cache_dir"] is None
        jax.config.update("jax_enable_compilation_cache", True)
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        assert enable_compilation_cache([cpu]) is True and enable_compilation_cache([gpu, gpu]) is True
        assert jax.config.values["jax_compilation_cache_dir"].endswith("/.cache/jaxtrain/xla")
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)


def test_a_file_where_a_cache_folder_must_be_turns_that_cache_off_with_one_warning(tmp_path, monkeypatch):
    """JAX alone warns on every entry it cannot read or write and compiles anyway; the program cache
    failed silently. Both now say it once, by name, and run without that cache."""
    import logging

    import jax

    from jaxtrain.cli.common import enable_compilation_cache
    from jaxtrain.kernels.cpu import program_cache
    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {k: jax.config.values[k] for k in keys}
    (tmp_path / "f").write_text("not a folder")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    monkeypatch.setattr(logging.getLogger("jaxtrain"), "handlers", [handler])  # whatever log_to_console set
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "f"))
    env = {program_cache.DIR_VAR: str(tmp_path / "f" / "programs")}
    try:
        assert enable_compilation_cache([jax.devices()[0]]) is False
        assert program_cache.enable(env) is False and not program_cache.enabled()
        assert jax.config.values["jax_enable_compilation_cache"] is False
        assert lines == [
            f"warning: JAX_COMPILATION_CACHE_DIR={tmp_path / 'f'}: '{tmp_path / 'f'}' is a file, not a folder, "
            f"so that cache is off for this run",
            f"warning: {program_cache.DIR_VAR}={tmp_path / 'f' / 'programs'}: '{tmp_path / 'f'}' is a file, not a "
            f"folder, so that cache is off for this run"]
        (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
        env = {program_cache.DIR_VAR: str(tmp_path / "dangling")}  # a folder that cannot be made
        lines.clear()
        assert program_cache.enable(env) is False and lines == [
            f"warning: {program_cache.DIR_VAR}={tmp_path / 'dangling'}: '{tmp_path / 'dangling'}' cannot be made "
            f"(File exists), so that cache is off for this run"]
        env = {program_cache.DIR_VAR: str(tmp_path / "new" / "programs")}  # nothing in the way: on, no warning
        lines.clear()
        assert program_cache.enable(env) is True and lines == [] and (tmp_path / "new" / "programs").is_dir()
    finally:
        program_cache.disable()
        for k, v in saved.items():
            jax.config.update(k, v)


STUCK_COMPILE = """
import sys, time
from jaxtrain.train import precompile
precompile.Precompile.train_step = lambda self, state, batch: time.sleep(120)  # the wait for it never ends
from jaxtrain.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_stuck_train_step_compile_ends_the_run_by_name(tmp_path):
    """``train.compile_timeout_s`` bounds the loop's wait for the train step's compile: exit 5 and the
    stacks file, as for a stuck step."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_COMPILE)
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script), "--config", "configs/shakespeare_char.yaml",
                           "train.steps=2", "train.compile_timeout_s=1", "checkpoint.enabled=false",
                           f"run.dir={tmp_path / 'run'}", "run.progress=false"],
                          cwd=repo, env={**os.environ, "XLA_FLAGS": xla_test_flags.with_devices(1)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 5, done.stderr[-2000:]
    assert re.search(r"error: train\.compile_timeout_s: the train step's compile did not finish in [\d.]+ s "
                     r"\(limit 1 s\)", done.stderr), done.stderr[-2000:]
    assert (tmp_path / "run" / "hang_stacks.process0.txt").is_file()
