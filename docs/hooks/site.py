"""MkDocs hooks: README.md and CHANGELOG.md as site pages, and the CLI and API references generated at build time."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}
"""Site page -> the repository file it is made from."""
LINKS = [(re.compile(r"\]\(docs/"), "]("), (re.compile(r"\]\((\.\./)?CHANGELOG\.md"), "](changelog.md")]
"""Links written for the repository's layout, rewritten for the site's (README's `docs/x.md` is the site's `x.md`)."""


def on_files(files: Any, config: Any) -> Any:
    """Add the pages made from files outside docs/."""
    from mkdocs.structure.files import File

    for page, source in PAGES.items():
        with open(os.path.join(ROOT, source), encoding="utf-8") as f:
            files.append(File.generated(config, page, content=_relink(f.read())))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Relink every page; fill the generated references."""
    markdown = _relink(markdown)
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- api-reference -->" in markdown:
        markdown = markdown.replace("<!-- api-reference -->", api_reference())
    return markdown


def _relink(markdown: str) -> str:
    for pattern, new in LINKS:
        markdown = pattern.sub(new, markdown)
    return markdown


def cli_reference() -> str:
    """Each command's `--help`, in the order `duplexpipe --help` lists them, from the parser itself."""
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; fix the width so the page is stable
    from duplexpipe.cli.main import build_parser

    parser = build_parser(with_train=True)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = ["## `duplexpipe`", "", "```text", parser.format_help().rstrip(), "```"]
    for name, command in sub.choices.items():
        out += ["", f"## `duplexpipe {name}`", "", "```text", command.format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


def api_reference() -> str:
    """One mkdocstrings entry per name in `duplexpipe.__all__`, classes (capitalised) then functions; the names are
    not imported (`duplexpipe` loads them lazily: importing them all would import torch and transformers)."""
    import duplexpipe

    classes = sorted(n for n in duplexpipe.__all__ if n[0].isupper())
    functions = sorted(n for n in duplexpipe.__all__ if not n[0].isupper())
    out = ["## Classes", ""] + [f"::: duplexpipe.{n}\n" for n in classes]
    out += ["## Functions", ""] + [f"::: duplexpipe.{n}\n" for n in functions]
    return "\n".join(out)
