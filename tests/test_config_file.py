"""``tensorpar train --config FILE.toml`` and ``--print-config`` (issue 26): every flag settable in
the file, the command line over it, bad keys and values refused in one line, the run directory's
``config.toml``."""

import argparse
import dataclasses
import os
import sys
import tomllib

import pytest

from tensorpar.cli import config_file
from tensorpar.cli.main import main
from tensorpar.cli.training_cli import add_train_flags, train_parser
from tests.cli_runner import run_tensorpar
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--eval-every", "0", "--no-progress", "--nproc", "1", "--tp", "1", "--warmup", "1"]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "text.txt"
    path.write_text("def add(a, b):\n    return a + b\n" * 400)
    return path


def _tensorpar(*argv, cwd=None):
    return run_tensorpar(argv, cwd=cwd)


def test_the_file_sets_flags_the_command_line_overrides_and_print_config_writes_nothing(tmp_path, text):
    (tmp_path / "run.toml").write_text(
        f'data = "{text}"\nsteps = 7\nseq-len = 16\nmicro_batch = 2\nlr = 0.001\nfsdp = true\ntensorboard = false\n'
        'overlap = "off"\nlayers = 2\nhidden = 32\nheads = 4\n')
    done = _tensorpar("train", "--config", "run.toml", "--steps", "9", "--nproc", "2", "--tp", "1",
                      "--print-config", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    printed = tomllib.loads(done.stdout)
    assert printed["steps"] == 9 and printed["lr"] == 0.001                      # the command line wins
    assert (printed["seq-len"], printed["micro-batch"], printed["fsdp"], printed["tensorboard"]) == (16, 2, True, False)
    assert (printed["nproc"], printed["tp"], printed["global-batch"]) == (2, 1, 4)  # resolved, as the run uses them
    assert "config" not in printed and "print-config" not in printed
    assert sorted(os.listdir(tmp_path)) == ["run.toml"]                          # no --out made, nothing launched
    # What --print-config writes is a config file that gives the same settings.
    (tmp_path / "printed.toml").write_text(done.stdout)
    again = _tensorpar("train", "--config", "printed.toml", "--print-config", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == done.stdout, again.stderr


def test_every_flag_of_the_parser_is_a_key_new_ones_included(tmp_path):
    parser = argparse.ArgumentParser(prog="tensorpar train")
    add_train_flags(parser)
    parser.add_argument("--later-flag", type=int, default=3)            # a flag added later: settable as is
    keys = config_file.settable(parser)
    # Each flag once: --tensorboard, not --no-tensorboard too.
    flags = {next(o for o in a.option_strings if o.startswith("--"))[2:] for a in parser._actions if a.option_strings}
    assert set(keys) == flags - {"help"} and {"later-flag", "seq-len", "no-progress", "tensorboard"} <= set(keys)
    (tmp_path / "run.toml").write_text("later-flag = 5\nno-progress = true\nno-tensorboard = 1\n")
    with pytest.raises(config_file.UsageError, match="unknown key no-tensorboard .did you mean tensorboard"):
        config_file.read(str(tmp_path / "run.toml"), parser=parser)
    (tmp_path / "run.toml").write_text("later-flag = 5\nno-progress = true\ntensorboard = false\n")
    assert config_file.read(str(tmp_path / "run.toml"), parser=parser) == {
        "later_flag": 5, "no_progress": True, "tensorboard": False}


@pytest.mark.parametrize("toml, message", [
    ("stepz = 5", "unknown key stepz (did you mean steps?)"),
    ("seq_length = 64", "unknown key seq_length (did you mean seq-len?)"),
    ("wandb_project_name = 'x'", "unknown key wandb_project_name"),
    ('steps = "50"', 'steps = "50": a number, written without quotes: steps = 50'),
    ("steps = 1.5", "steps = 1.5: expected an integer in (0, 1000000000000], got '1.5'"),
    ("steps = 0", "steps = 0: must be an integer in (0, 1000000000000], got 0"),
    ("steps = true", "steps = true: expected a number or text in quotes, not true/false"),
    ("steps = [1, 2]", "steps = [1, 2]: expected a number or text in quotes, not list"),
    ("lr = nan", "lr = nan: must be a finite number > 0, got nan"),
    ("fsdp = 1", "fsdp = 1: fsdp is a switch, write fsdp = true or fsdp = false"),
    ("data = 5", 'data = 5: expected text, in quotes: data = "5"'),
    ('dtype = "fp16"', 'dtype = "fp16": choose from fp32, bf16'),
    ("config = 'other.toml'", "unknown key config"),
    ("[run]\nsteps = 5", "[run] is a table; keys go at the top level, named like the flags"),
])
def test_bad_keys_and_values_are_one_line_naming_the_key(capsys, tmp_path, toml, message):
    path = tmp_path / "run.toml"
    path.write_text(toml + "\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"tensorpar train: error: --config {path}: {message}"), err


def test_an_unreadable_or_invalid_file_and_a_mistyped_key_through_the_command(capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert capsys.readouterr().err == f"tensorpar train: error: --config {tmp_path / 'none.toml'}: No such file or directory\n"
    (tmp_path / "bad.toml").write_text("steps = = 5\n")
    assert main(["train", "--config", str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tensorpar train: error: --config {tmp_path / 'bad.toml'} is not valid TOML: ") and \
        err.count("\n") == 1, err
    (tmp_path / "run.toml").write_text("steps = 5\nseq-lenn = 64\n")
    done = _tensorpar("train", "--config", "run.toml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == ("tensorpar train: error: --config run.toml: unknown key seq-lenn (did you mean seq-len?); "
                           "see tensorpar train --help\n")


def test_values_round_trip_through_the_toml_written():
    parser = train_parser()
    args = parser.parse_args(["--data", 'a "quoted"\\path\n\x7f\u00e9', "--lr", "1e-10", "--overlap", "auto",
                              "--tensorboard", "--fsdp", "--steps", "3"])
    text = config_file.dumps(args, parser=parser)
    table = tomllib.loads(text)
    assert table["data"] == args.data and table["lr"] == 1e-10 and table["overlap"] == "auto"
    assert (table["tensorboard"], table["fsdp"], table["no-progress"], table["steps"]) == (True, True, False, 3)
    assert "resume" not in table  # None: left to its default


def _main_body(argv):
    return main(argv)


def test_a_run_keeps_its_config_and_a_resumed_one_prints_the_checkpoint_settings(capsys, tmp_path, text):
    out = tmp_path / "run"
    assert run_on_ranks(_main_body, 1, ["train", *TINY, "--steps", "2", "--lr", "0.002", "--data", str(text),
                                        "--out", str(out)])[0] == 0
    kept = tomllib.loads((out / "config.toml").read_text())
    assert (kept["steps"], kept["lr"], kept["seq-len"], kept["data"]) == (2, 0.002, 32, str(text))
    assert not {"out", "overwrite", "resume"} & set(kept)  # reused as a template, it starts a new run
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]
    # Resumed: the settings come from the checkpoint unless a flag gives another value.
    assert main(["train", "--resume", str(out), "--steps", "4", "--nproc", "1", "--print-config"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert (printed["steps"], printed["lr"], printed["seq-len"], printed["micro-batch"]) == (4, 0.002, 32, 2)
    assert "resume" not in printed and printed["data"] == str(text)
    assert tomllib.loads((out / "config.toml").read_text()) == kept      # printing wrote nothing


def test_config_toml_is_never_written_through_a_link(capsys, tmp_path, text):
    out = tmp_path / "run"
    out.mkdir()
    target = tmp_path / "elsewhere.toml"
    (out / "config.toml").symlink_to(target)
    assert main(["train", *TINY, "--steps", "1", "--data", str(text), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"tensorpar train: error: {out / 'config.toml'} is a symlink; tensorpar never "
                                       "writes through links in a run directory: remove it\n")
    assert not target.exists()


def test_without_tomllib_config_is_refused_in_one_line(capsys, monkeypatch, tmp_path):
    """Python 3.10 has no tomllib: --config says what it needs, the rest of the command works."""
    (tmp_path / "run.toml").write_text("steps = 5\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    assert main(["train", "--config", str(tmp_path / "run.toml")]) == 2
    assert capsys.readouterr().err == (
        f"tensorpar train: error: --config needs Python 3.11 or newer (the standard library's tomllib); this is "
        f"Python {sys.version_info.major}.{sys.version_info.minor}\n")


_UNREADABLE = {
    "nested arrays": ("steps = " + "[" * 3000 + "]" * 3000 + "\n", " is not valid TOML (nested too deeply)"),
    "nested tables": ("steps = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n", " is not valid TOML (nested too deeply)"),
    "latin-1": ('data = "caf\xe9"\n'.encode("latin-1"), " is not valid TOML (not UTF-8: byte 11 is 0xe9)"),
    "utf-16": ("steps = 5\n".encode("utf-16"), " is not valid TOML (not UTF-8: byte 0 is 0xff)"),
    "a key spelled twice": ("seq_len = 32\nseq-len = 64\n", ": seq_len and seq-len set the same flag: keep one"),
    "overwrite": ("overwrite = true\n", ": overwrite is a one-time switch that touches files"),
    "resume": ('resume = "run"\n', ": resume is a one-time switch that touches files"),
    "over 1 MiB": ("#" * (1 << 20) + "\nsteps = 5\n", " is larger than 1 MiB"),
}


@pytest.mark.parametrize("case", list(_UNREADABLE))
def test_a_config_file_tensorpar_cannot_take_is_one_line_exit_2(capsys, tmp_path, case):
    content, message = _UNREADABLE[case]
    path = tmp_path / "run.toml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tensorpar train: error: --config {path}{message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_config_that_is_no_regular_file_is_refused_before_it_is_read(capsys, tmp_path, kind):
    """A FIFO blocked forever; /dev/zero read until memory ran out."""
    if kind == "fifo":
        path = tmp_path / "run.toml"
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    assert main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (f"tensorpar train: error: --config {path} is not a regular file (a pipe or a "
                                       "device never ends, or blocks): give a TOML file\n")


def test_a_file_naming_a_run_directory_starts_nothing_there_without_a_command_line_flag(capsys, tmp_path, text):
    """A run's config.toml reused with another flag cannot delete or continue the run: it names no
    directory, and a file that does (out = RUN) is refused while RUN holds a run."""
    out = tmp_path / "run"
    assert run_on_ranks(_main_body, 1, ["train", *TINY, "--steps", "1", "--data", str(text), "--out", str(out),
                                        "--overwrite"])[0] == 0
    before = sorted(os.listdir(out))
    (tmp_path / "reused.toml").write_text((out / "config.toml").read_text() + f'out = "{out}"\n')
    assert main(["train", "--config", str(tmp_path / "reused.toml"), "--lr", "1e-3", "--nproc", "1"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == before


def test_the_run_config_has_a_typed_field_for_every_train_flag_and_refuses_others():
    from tensorpar.training.run_config import RunConfig

    flags = {action.dest for action in config_file.settable(train_parser()).values()}
    resolved = {"given_settings", "run_config", "micro_batch_chosen", "data_from_checkpoint"}
    assert {field.name for field in dataclasses.fields(RunConfig)} == flags | resolved
    run = RunConfig.from_flags(argparse.Namespace(**vars(train_parser().parse_args(["--steps", "3"])),
                                                  command="train", config=None, print_config=False, debug=False))
    assert run.steps == 3 and run.given_settings is None and "steps" in run.settings()
    with pytest.raises(AttributeError):
        run.stepz = 4                                        # a misspelt setting is caught
    with pytest.raises(TypeError):
        RunConfig.from_flags(argparse.Namespace(**vars(train_parser().parse_args([])), new_flag=1))
