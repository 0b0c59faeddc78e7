"""The tables of docs/results/*.md that come from committed sweeps are generated, not typed: each sits
between markers naming the `fedbed report` command that writes it (`fedbed.doc_tables`), and this
test re-runs every such command on the committed records under results/sweeps/ and fails when a
doc's table differs from what they give (`fedbed update-docs docs/results/X.md` rewrites it)."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedbed.cli import app, report_block_text
from fedbed.doc_tables import CLOSING, report_blocks, rewrite_blocks
from tests.test_reporting import write_sweep

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs" / "results").glob("*.md"))
runner = CliRunner()


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_generated_table_is_what_the_committed_records_give(doc, monkeypatch):
    monkeypatch.chdir(ROOT)  # the blocks' folders are relative to the checkout
    text = doc.read_text()
    new, changed = rewrite_blocks(text, report_block_text)
    if changed:
        diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), "typed", "from the records", n=1))
        pytest.fail(f"{doc.name}: the block(s) at line(s) {', '.join(str(block.line) for block in changed)} differ from "
                    f"what their commands give; run `fedbed update-docs {doc.relative_to(ROOT)}`\n{diff}")


def blocks_of(name: str):
    return report_blocks((ROOT / "docs" / "results" / name).read_text())


def test_the_mcgdm_and_fedadg_docs_generate_their_tables():
    # Table 4 (four targets and three seeds), its t-tests, Tables 5 and 6, the authors' code, FedDA on PACS and
    # RotatedMNIST; FedADG's Tables 5 and 8.
    assert len(blocks_of("pacs32-mcgdm.md")) >= 10 and len(blocks_of("pacs32-fedadg.md")) >= 2
    # Table 6's paired tests come from the tool, over both folders: no job copied, no test run by hand.
    table6 = [block for block in blocks_of("pacs32-mcgdm.md")
              if {"results/sweeps/pacs32-mcgdm-amplitude-mix", "results/sweeps/pacs32-mcgdm-seeds"} <= set(block.arguments)]
    assert table6 and any("--compare" in block.arguments or "--baseline" in block.arguments for block in table6)
    # New variants of FedADG's sweep show up in its Table 5 when the block is regenerated: no row filter there.
    assert "--label" not in blocks_of("pacs32-fedadg.md")[0].arguments


def test_update_docs_rewrites_the_blocks_from_the_records_and_check_names_what_differs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_sweep(tmp_path / "sweep", [("fedavg", {}, "a", 0, 70, 30.0), ("fedavg", {}, "a", 1, 72, 10.0)], {})
    doc = tmp_path / "doc.md"
    typed = "| fedavg | 25.0 |"  # typed by hand: the records give 20.0 ± 14.1
    doc.write_text(f"# Results\n\nProse before.\n\n<!-- fedbed report sweep --selection last\n     --label fedavg -->\n"
                   f"{typed}\n{CLOSING}\n\nProse after.\n")
    check = runner.invoke(app, ["update-docs", str(doc), "--check"])
    assert check.exit_code == 1 and f"{doc}:5: differs: fedbed report sweep --selection last --label fedavg" in check.output
    assert typed in doc.read_text()  # --check writes nothing
    result = runner.invoke(app, ["update-docs", str(doc)])
    assert result.exit_code == 0 and "1 generated block(s), 1 rewritten" in result.output
    text = doc.read_text()
    report = runner.invoke(app, ["report", "sweep", "--selection", "last", "--label", "fedavg"]).stdout.strip("\n")
    assert "| fedavg | 20.0 ± 14.1 |" in report
    assert text == (f"# Results\n\nProse before.\n\n<!-- fedbed report sweep --selection last\n     --label fedavg -->\n\n"
                    f"{report}\n\n{CLOSING}\n\nProse after.\n")
    assert runner.invoke(app, ["update-docs", str(doc), "--check"]).exit_code == 0


@pytest.mark.parametrize("block, message", [
    ("<!-- fedbed report sweep -->\n| a |\n", "line 3: the block has no '<!-- end fedbed report -->'"),
    (f"<!-- fedbed report sweep --html page.html -->\n{CLOSING}\n", "drop --html, --output and --format"),
    (f"<!-- fedbed report sweep --label ppdg -->\n{CLOSING}\n", "line 3: fedbed report sweep --label ppdg: label 'ppdg'"),
    (f"<!-- fedbed report sweep --colour red -->\n{CLOSING}\n", "line 3: fedbed report sweep --colour red: No such option '--colour'"),
    (f"<!-- fedbed report 'sweep -->\n{CLOSING}\n", "line 3: the command does not parse"),
])
def test_a_bad_block_is_one_line_naming_it(tmp_path, monkeypatch, block, message):
    monkeypatch.chdir(tmp_path)
    write_sweep(tmp_path / "sweep", [("fedavg", {}, "a", 0, 70, 30.0)], {})
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Results\n\n{block}")
    result = runner.invoke(app, ["update-docs", str(doc)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert message in result.output and "Traceback" not in result.output
    assert doc.read_text() == f"# Results\n\n{block}"


def test_no_line_of_prose_starts_with_a_plus_that_markdown_would_make_a_list():
    """"+ intra" (a row's name) at the start of a wrapped line opens a bullet list in CommonMark
    (a list item may interrupt a paragraph); the docs write "\\+ intra" there."""
    import re

    offenders = [f"{path.relative_to(ROOT)}:{number}" for path in [*DOCS, ROOT / "README.md", ROOT / "docs" / "architecture.md"]
                 for number, line in enumerate(path.read_text().splitlines(), 1) if re.match(r" *\+ ", line)]
    assert not offenders, offenders
