"""README.md shows what gpupool really prints: its console blocks are run as written, on the
example snapshot shipped in the repository, and the output must match (lines the README cuts
are marked ``...``; replay speed, which varies, is not compared). Its Python example runs."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from gpupool import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def _console(command: str) -> list[str]:
    """The lines the README shows under ``$ command``."""
    for block in _blocks("console"):
        first, *shown = block.rstrip("\n").split("\n")
        if first == f"$ {command}":
            return shown
    raise AssertionError(f"README.md has no console block for {command!r}")


def _run(command: str, capsys, monkeypatch) -> list[str]:
    monkeypatch.chdir(ROOT)
    words = shlex.split(command)
    assert words[0] == "gpupool"
    cli.main(words[1:])
    return capsys.readouterr().out.rstrip("\n").split("\n")


def _contains_in_order(shown: list[str], printed: list[str]) -> None:
    """Each run of shown lines between ``...`` markers stands in ``printed``, in order."""
    runs, current = [], []
    for line in shown:
        if line == "...":
            runs.append(current)
            current = []
        else:
            current.append(line)
    runs.append(current)
    at = 0
    for run in filter(None, runs):
        found = next((i for i in range(at, len(printed)) if printed[i : i + len(run)] == run), None)
        assert found is not None, f"not printed (in this order): {run}"
        at = found + len(run)


def test_the_advise_block_is_what_advise_prints(capsys, monkeypatch):
    command = "gpupool advise examples/snapshots/training_step.pickle"
    shown = _console(command)
    assert len(shown) > 10 and "Answer" in shown
    _contains_in_order(shown, _run(command, capsys, monkeypatch))


def test_the_replay_block_is_what_replay_prints(capsys, monkeypatch):
    [command] = [b.split("\n")[0][2:] for b in _blocks("console") if b.startswith("$ gpupool replay")]
    shown = _console(command)
    printed = _run(command, capsys, monkeypatch)
    # All but the last column, events per second.
    assert [row.rsplit("|", 2)[0] for row in shown] == [row.rsplit("|", 2)[0] for row in printed]


def test_the_python_example_prints_what_its_comments_say(monkeypatch, capsys):
    [example] = [b for b in _blocks("python") if "gpupool.Pool" in b]
    monkeypatch.chdir(ROOT)
    exec(compile(example, "README.md", "exec"), {})
    said = [line.split("# ")[1].split(":")[0] for line in example.splitlines() if line.startswith("print(")]
    assert capsys.readouterr().out.splitlines() == said


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 150


@pytest.mark.parametrize("path", re.findall(r"\]\(([^)#]+)\)", README))
def test_every_link_leads_to_a_file(path):
    assert (ROOT / path).exists(), path
