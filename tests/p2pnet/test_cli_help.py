"""The help a user reads: every command has a one-line summary, help for each argument and an
example that parses; groups list their commands; logging flags work anywhere on the line."""

import argparse
import shlex
import subprocess
import sys

import pytest

from p2pnet.cli import build_parser, log_level


def commands(parser, path=()):
    """(command words, parser) for every command and group under `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from commands(sub, (*path, name))


ALL = list(commands(build_parser()))


def example_commands(epilog):
    """The `p2pnet ...` command lines of an epilog (continuations joined; sudo, comments and
    redirections cut off), without the leading `p2pnet`."""
    joined = epilog.split("\n", 1)[1].replace("\\\n", " ")
    for line in joined.splitlines():
        command = line.partition("p2pnet ")[2].split("#")[0].split(" > ")[0]
        if command.strip():
            yield command


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "p2pnet", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("words, parser", ALL, ids=[" ".join(w) for w, _ in ALL])
def test_each_command_has_a_summary_argument_help_and_an_example_that_parses(words, parser):
    summary = (parser.description or "").split("\n")[0]
    assert summary and summary.endswith(".") and not summary.startswith(('"', "`p2pnet")), summary
    assert parser.epilog and parser.epilog.startswith("example:\n"), words
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"p2pnet {' '.join(words)}: {action.option_strings or action.dest} has no help"
    for example in example_commands(parser.epilog):
        argv = shlex.split(example)
        assert argv[:len(words)] == list(words), example
        if argv[len(words):] or not parser._defaults.get("_group"):
            with_placeholders = [a.replace("...", "x") for a in argv]
            try:
                build_parser().parse_args(with_placeholders)
            except SystemExit as exc:
                pytest.fail(f"the example `p2pnet {example.strip()}` does not parse ({exc})")


def test_a_group_alone_lists_its_commands_not_the_top_level_help():
    out = run_cli("peer")
    assert out.returncode == 2
    assert out.stdout.startswith("usage: p2pnet peer")
    for command in ("start", "status", "announce", "id"):
        assert f"    {command} " in out.stdout
    assert "devnet" not in out.stdout


def test_devnet_help_opens_with_a_summary_not_a_docstring():
    out = run_cli("devnet", "--help")
    description = out.stdout.split("\n\n")[1]
    assert description.startswith("Run a whole training network on this machine")
    assert "`p2pnet devnet`:" not in out.stdout


def test_a_usage_mistake_is_one_line_pointing_at_the_help():
    out = run_cli("checkpoint", "fetch", "newest", "--out", "x")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "newest" in out.stderr
    assert "see `p2pnet checkpoint fetch --help`" in out.stderr


@pytest.mark.parametrize("argv, level", [
    ([], "warning"),
    (["-v"], "info"),
    (["-vv"], "debug"),
    (["-vvv"], "trace"),
    (["-vvvv"], "trace"),
    (["-q"], "error"),
    (["--log-level", "debug", "-q"], "info"),
])
def test_v_and_q_anywhere_on_the_line(argv, level):
    parser = build_parser()
    assert log_level(parser.parse_args([*argv, "sim", "list"])) == level
    assert log_level(parser.parse_args(["sim", "list", *argv])) == level
    assert log_level(parser.parse_args(["sim", *argv, "list"])) == level


def test_v_before_and_after_the_command_add_up():
    assert log_level(build_parser().parse_args(["-v", "peer", "status", "-v"])) == "debug"
