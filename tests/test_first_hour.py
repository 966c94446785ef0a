"""A new user's first hour: what the command line shows before, around and after a run.

Help at 80 columns, the line that says what is loading, the batch summary's
headline, chat's last newline and the sweep's row for generate's own default.
"""

from __future__ import annotations

from typer.testing import CliRunner

from specdec_cli.cli import app


def test_no_arguments_print_the_help_once_and_exit_two():
    result = CliRunner().invoke(app, [])
    # Typer's own no_args_is_help exit: asking for nothing is a usage error.
    assert result.exit_code == 2
    assert result.stdout.count("Usage:") == 1 and "generate" in result.stdout
    assert result.stderr == ""
