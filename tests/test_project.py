"""The project's contract: README commands, CI script, public API, fixture programs, CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import branchtrace

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:25])
    return re.findall(r"```sh\n(.+?)\n```", first_screen)


def test_readme_first_screen_has_exactly_two_commands():
    install, test = readme_commands()
    assert install.startswith("pip install -e . && branchtrace ")
    assert test.startswith("pip install -e '.[test]' && ")


def test_ci_runs_the_readme_test_command_verbatim():
    _, test = readme_commands()
    lines = [
        ln
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln and not ln.startswith("#") and not ln.startswith(("set ", "cd "))
    ]
    assert lines == [test]


def test_public_api_is_exported():
    for name in branchtrace.__all__:
        assert getattr(branchtrace, name) is not None
    assert {"TaskTrace", "Flags", "Mode", "RingWriter", "RingReader"} <= set(branchtrace.__all__)


def test_fixture_programs_build_and_give_known_output(programs):
    def run(name: str, *args: str) -> str:
        return subprocess.run(
            [programs[name], *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    assert run("abc") == "34"  # c(b(a(5))) = 3 * (10 + 1) + 1
    assert run("loop23") == str(sum(range(23)))
    assert run("fib", "20") == "6765"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "branchtrace.cli.main", *args], capture_output=True, text=True
    )


def test_demo_records_the_example_crash_and_shows_how_it_got_there(tmp_path):
    res = cli("demo", "-o", str(tmp_path / "data"))
    assert res.returncode == 0, res.stderr
    assert "linked_list was killed by SIGSEGV" in res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.strip()[:2].strip().isdigit()]
    newest = rows[-1]
    assert newest[0] == "0" and newest[1].startswith("main+") and newest[2] == "total"
    assert newest[3].startswith("linked_list.c:") and newest[-1] == "call"
    assert any(r[1].startswith("find+") and r[2].startswith("main+") for r in rows)  # returned


def test_store_demo_then_info(tmp_path):
    out = tmp_path / "data"
    res = cli("demo", "--store", "-o", str(out), "-n", "2000000")
    assert res.returncode == 0, res.stderr
    assert "received 2,000,001 records" in res.stdout and "lost 0" in res.stdout
    rows = [json.loads(line) for line in cli("info", str(out), "--json").stdout.splitlines()]
    by_name = {Path(r["path"]).name: r for r in rows}
    assert by_name["demo-wrap.bts"]["mode"] == "wrap"
    assert by_name["demo-wrap.bts"]["records"] >= 65536 * 7 // 8 // 8
    assert by_name["demo-stream.bts"]["lost"] == 0
    assert by_name["demo-stream.bts"]["writer"] == "closed"


@pytest.mark.parametrize(
    ("content", "code", "message"),
    [(None, 3, "no such file"), (b"not a store", 4, "not a valid branchtrace store")],
)
def test_info_bad_input_is_one_line_with_its_own_exit_code(tmp_path, content, code, message):
    path = tmp_path / "x.bts"
    if content is not None:
        path.write_bytes(content)
    res = cli("info", str(path))
    assert res.returncode == code
    assert message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
