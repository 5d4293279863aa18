"""The docs keep up with the code (datasette-style): every hook documented and tested, every CLI command real."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from trl_credit import hookspecs
from trl_credit.hookspecs import HOOKS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _spec_argnames(hook: str) -> list[str]:
    return list(inspect.signature(getattr(hookspecs, hook)).parameters)


def _hook_impls_in_tests() -> dict[str, list[str]]:
    """Hook name -> files under tests/ that define it as a plugin method.

    A match is ``def <hook>(self, <args>)`` whose arguments are a subset of the hookspec's, so a
    `transformers.TrainerCallback.on_step_end(self, args, state, control)` does not count.
    """
    files = sorted(ROOT.glob("tests/**/*.py"))
    found: dict[str, list[str]] = {hook: [] for hook in HOOKS}
    for path in files:
        text = path.read_text(encoding="utf-8")
        for hook in HOOKS:
            allowed = set(_spec_argnames(hook))
            for match in re.finditer(rf"def {hook}\(\s*self\b([^)]*)\)", text):
                params = re.sub(r"\[[^\]]*\]", "", match.group(1))  # drop subscripts: dict[str, float]
                args = {re.split(r"[:=]", a)[0].strip() for a in params.split(",")} - {""}
                if args <= allowed:
                    found[hook].append(str(path.relative_to(ROOT)))
                    break
    return found


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert len(doc.strip()) > 20, f"hookspec {hook} has no real docstring"


def test_hooks_md_has_a_section_per_hook():
    text = (DOCS / "hooks.md").read_text(encoding="utf-8")
    headings = {m.group(1) for m in re.finditer(r"^##\s+`?(\w+)`?\s*$", text, re.M)}
    missing = [hook for hook in HOOKS if hook not in headings]
    assert not missing, f"docs/hooks.md lacks a '## <hook>' section for: {missing}"
    assert "Stateful" in headings, "docs/hooks.md lacks a '## Stateful' section"


def test_hooks_md_documents_no_unknown_hook():
    text = (DOCS / "hooks.md").read_text(encoding="utf-8")
    documented = re.findall(r"^```python\n@hookimpl\ndef (\w+)\(", text, re.M)
    assert sorted(documented) == sorted(HOOKS), "signature blocks in docs/hooks.md differ from HOOKS"


def test_every_hook_is_implemented_by_a_test_plugin():
    found = _hook_impls_in_tests()
    untested = [hook for hook, files in found.items() if not files]
    assert not untested, f"no test under tests/ implements these hooks as a plugin method: {untested}"


def _cli_commands(markdown: str) -> set[str]:
    """`trl-credit <cmd>` in inline code, and command lines (``$ trl-credit <cmd>``) in code blocks."""
    inline = re.findall(r"`trl-credit ([a-z][a-z-]*)", markdown)
    blocks = "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.M | re.S))
    lines = re.findall(r"^\s*(?:\$\s+)?trl-credit ([a-z][a-z-]*)", blocks, re.M)
    return set(inline) | set(lines)


@pytest.mark.parametrize("doc", ["configuration.md", "tutorial.md", "hooks.md", "index.md"])
def test_cli_commands_named_in_docs_exist(doc, capsys):
    from trl_credit.app.cli import main

    commands = _cli_commands((DOCS / doc).read_text(encoding="utf-8"))
    if doc == "configuration.md":
        assert {"train", "validate", "plugins", "new-plugin", "install"} <= commands
    for command in sorted(commands):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0, f"docs/{doc} names `trl-credit {command}`, which the CLI does not have"
    capsys.readouterr()


def test_index_links_every_doc():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "index.md":
            assert f"({page.name}" in index, f"docs/index.md does not link {page.name}"
