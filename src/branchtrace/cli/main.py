"""The `branchtrace` command: the only place that parses arguments, prints and exits."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from ..errors import BranchtraceError
from . import demo, info, record, views

err = Console(stderr=True, highlight=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="branchtrace")
def cli() -> None:
    """Record and read the branch trace of native Linux x86-64 programs."""


cli.add_command(info.info)
cli.add_command(demo.demo)
cli.add_command(record.record)
for view in (views.show, views.calls, views.insns, views.stats):
    cli.add_command(view)


def main(argv: list[str] | None = None) -> None:
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


if __name__ == "__main__":
    main()
