"""The `branchtrace` command: the only place that parses arguments, prints and exits."""

from __future__ import annotations

import importlib
import sys

import click
from rich.console import Console

from ..errors import BranchtraceError

err = Console(stderr=True, highlight=False)

#: command -> module defining it.  Imported when used (click's lazy loading): the views
#: pull in numba, which `record` must not pay for in its start-up.
COMMANDS = {
    "record": "record",
    "info": "info",
    "show": "views",
    "calls": "views",
    "insns": "views",
    "stats": "views",
    "demo": "demo",
    "probe": "probe",
}

_raw_args: list[str] = []


def raw_args() -> list[str]:
    """The command line as given (where `--` was, which click does not tell).  Run as
    `python -m`, this module is loaded twice and only `__main__` saw main()'s argument."""
    return _raw_args or sys.argv[1:]


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"{__package__}.{COMMANDS[name]}")
        command: click.Command = getattr(module, name)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="branchtrace")
def cli() -> None:
    """Record and read the branch trace of native Linux x86-64 programs."""


def main(argv: list[str] | None = None) -> None:
    _raw_args[:] = sys.argv[1:] if argv is None else argv
    try:
        cli.main(args=argv, prog_name="branchtrace", standalone_mode=False)
    except click.exceptions.Abort:
        err.print("branchtrace: interrupted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except BranchtraceError as e:
        hint = f" (hint: {e.hint})" if e.hint else ""
        err.print(f"branchtrace: error: {e}{hint}", soft_wrap=True, markup=False)
        sys.exit(e.exit_code)
    except BrokenPipeError:
        sys.exit(0)
    except MemoryError:
        # the views read a trace a piece at a time; what is left needing more memory than
        # the machine has is said in a line, not a traceback
        err.print(
            "branchtrace: error: not enough memory for this (hint: --tid T reads one thread "
            "at a time)",
            soft_wrap=True,
            markup=False,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
