"""The `mmcache` parser is built for the command run: a service command's start imports
neither the simulator nor the bench, and ``--help`` still lists every command."""

from __future__ import annotations

import subprocess
import sys

from stream.cli import _parser

LOADED = ("import sys; from stream.cli import _parser; _parser({command!r}); "
          "print(sorted(m for m in sys.modules if m.startswith(('stream.sim', 'stream.bench'))))")


def _modules_loaded_for(command: str | None) -> str:
    done = subprocess.run([sys.executable, "-c", LOADED.format(command=command)],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_a_service_command_imports_neither_the_simulator_nor_the_bench():
    for command in ("serve", "broker", "rebuild", "state"):
        assert _modules_loaded_for(command) == "[]", command


def test_any_other_command_and_help_get_every_command():
    assert "stream.sim.commands" in _modules_loaded_for(None)
    commands = _parser(None)._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"serve", "broker", "rebuild", "state", "bench", "simulate", "tune", "export"} <= set(commands)
    assert _parser("simulate").parse_args(["simulate", "--seed", "3"]).seed == 3
    assert _parser("serve").parse_args(["serve", "--port", "9"]).port == 9
