"""The README's CLI tour runs as written, at a tiny budget: every line's command and flags exist,
and every complete line runs (DATA is a data root holding the real PACS files; the runs the plot
lines name are made first)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
from PIL import Image
from typer.main import get_command
from typer.testing import CliRunner

from fedbed.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"
runner = CliRunner()


def tour_lines() -> list[list[str]]:
    """The commands of the README's "CLI tour" block, continuation lines joined, comments dropped."""
    text = README.read_text()
    block = re.search(r"## CLI tour\n\n```bash\n(.*?)```", text, flags=re.S).group(1)
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def command_of(words: list[str]):
    """The click command a tour line names, and the words after it."""
    command, rest = get_command(app), words[1:]
    while rest and hasattr(command, "commands") and rest[0] in command.commands:
        command, rest = command.commands[rest[0]], rest[1:]
    return command, rest


def tiny(words: list[str]) -> list[str]:
    """A run line at a tiny budget: one round of one local step."""
    if words[:2] != ["fedbed", "run"]:
        return words
    shrunk, skip = [], False
    for index, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word in ("--rounds", "--local-epochs"):
            skip = True
            continue
        shrunk.append(word)
    return [*shrunk, "--rounds", "1", "--local-steps", "1", "--no-progress"]


def test_every_command_and_flag_of_the_tour_exists():
    lines = tour_lines()
    assert len(lines) >= 10
    for words in lines:
        assert words[0] == "fedbed"
        command, rest = command_of(words)
        known = {option for parameter in command.params for option in (*parameter.opts, *parameter.secondary_opts)}
        flags = {word.split("=")[0] for word in rest if word.startswith("--")}
        assert flags <= known | {"--help"}, f"{' '.join(words)}: unknown {sorted(flags - known)}"


def test_every_complete_line_of_the_tour_runs(shared_data, tmp_path, monkeypatch):
    data = tmp_path / "DATA"
    (data / "pacs").mkdir(parents=True)
    for packed in (shared_data / "pacs").glob("pacs_*.npz"):
        (data / "pacs" / packed.name).symlink_to(packed)
    fresh = tmp_path / "FRESH"  # `data prepare` writes its file: a root of its own, never the shared files
    fresh.mkdir()
    (fresh / "PACS").symlink_to(shared_data / "pacs-mini")
    work = tmp_path / "work"
    work.mkdir()
    (work / "docs").symlink_to(README.parent / "docs")
    rng = np.random.default_rng(0)
    for domain in ("art", "studio"):  # ./photos, the user's own folder tree
        for label in ("cat", "dog"):
            folder = work / "photos" / domain / label
            folder.mkdir(parents=True)
            for number in range(6):
                Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(folder / f"{number}.png")
    monkeypatch.chdir(work)
    monkeypatch.setenv("FEDBED_DATA", str(data))
    for algorithm in ("ppdg", "fedadg"):  # the runs the plot lines name
        made = runner.invoke(app, tiny(["fedbed", "run", "--algorithm", algorithm])[1:])
        assert made.exit_code == 0, made.output
    ran = 0
    for words in tour_lines():
        if "..." in words:  # a shorthand for "the run above, plus"
            continue
        words = [str(fresh if "prepare" in words else data) if word == "DATA" else word for word in tiny(words)]
        result = runner.invoke(app, words[1:])
        assert result.exit_code == 0, f"{' '.join(words)}:\n{result.output}"
        ran += 1
    assert ran >= 9
    assert (fresh / "pacs" / "pacs_32.npz").is_file()
