"""Generated tables in Markdown docs: each sits between two markers, the first naming the
``fedbed report`` command that writes it,

.. code-block:: markdown

    <!-- fedbed report results/sweeps/pacs32-mcgdm-seeds --selection last_five_mean --baseline fedavg -->

    (what that command prints: its tables and notes)

    <!-- end fedbed report -->

so that a results doc quotes no table by hand. :func:`rewrite_blocks` replaces every block's
text with what its command prints now (``fedbed update-docs``); ``tests/test_results_docs.py``
fails when a committed doc's block differs from what the committed records give. The command
may span lines inside the opening comment and quotes its words as a shell does (``shlex``);
folders are relative to the directory the docs are updated from (the checkout's root).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass

OPENING = "<!-- fedbed report"
"""How the opening marker of a generated block begins; the command follows, up to ``-->``."""
CLOSING = "<!-- end fedbed report -->"
"""The closing marker of a generated block."""


class DocTablesError(ValueError):
    """A malformed marker, or a block whose command fails (the message names the line)."""


@dataclass(frozen=True)
class ReportBlock:
    """One generated block of a doc.

    Attributes:
        arguments: the words of the command after ``fedbed report``.
        line: the line of the opening marker (1-based).
        start: the offset, in the doc's text, of the first character after the opening marker's line.
        end: the offset of the closing marker.
    """

    arguments: list[str]
    line: int
    start: int
    end: int

    @property
    def command(self) -> str:
        """The block's command as a shell would take it."""
        return shlex.join(["fedbed", "report", *self.arguments])


def report_blocks(text: str) -> list[ReportBlock]:
    """The generated blocks of a Markdown text, in order.

    Raises:
        DocTablesError: an opening marker not closed by ``-->`` or by :data:`CLOSING` before the
            next block, or a command whose quotes do not balance (naming the line).
    """
    blocks = []
    position = 0
    while (opening := text.find(OPENING, position)) >= 0:
        line = text.count("\n", 0, opening) + 1
        comment_end = text.find("-->", opening)
        if comment_end < 0:
            raise DocTablesError(f"line {line}: the marker {OPENING!r} is not closed by '-->'")
        newline = text.find("\n", comment_end)
        start = len(text) if newline < 0 else newline + 1
        end = text.find(CLOSING, start)
        following = text.find(OPENING, start)
        if end < 0 or 0 <= following < end:
            raise DocTablesError(f"line {line}: the block has no {CLOSING!r} before the next block or the end")
        try:
            arguments = shlex.split(text[opening + len(OPENING):comment_end])
        except ValueError as error:
            raise DocTablesError(f"line {line}: the command does not parse ({error})") from None
        blocks.append(ReportBlock(arguments, line, start, end))
        position = end + len(CLOSING)
    return blocks


def block_text(rendered: str) -> str:
    """The text between a block's markers for a command's output: the output between blank
    lines, so that Markdown reads its tables as tables."""
    return "\n" + rendered.strip("\n") + "\n\n"


def rewrite_blocks(text: str, render: Callable[[list[str]], str]) -> tuple[str, list[ReportBlock]]:
    """``text`` with every generated block's text replaced by :func:`block_text` of
    ``render(block.arguments)`` (the command's output), and the blocks whose text changed.

    Raises:
        DocTablesError: a malformed marker (:func:`report_blocks`), or ``render`` raising a
            ``ValueError`` (named with the block's line and command).
    """
    parts, changed, position = [], [], 0
    for block in report_blocks(text):
        try:
            new = block_text(render(block.arguments))
        except ValueError as error:
            raise DocTablesError(f"line {block.line}: {block.command}: {error}") from None
        if text[block.start:block.end] != new:
            changed.append(block)
        parts += [text[position:block.start], new]
        position = block.end
    return "".join(parts + [text[position:]]), changed
