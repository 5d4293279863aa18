"""The generated parts of docs/hooks.md: one block per hook from its hookspec, and the plugin members table.

The hookspec docstrings (`trl_credit.hookspecs`) and the `trl_credit.plugin` module docstring are the one
source; ``python -m trl_credit.app.docs`` rewrites the blocks between ``<!-- BEGIN generated: X -->`` and
``<!-- END generated: X -->`` markers, and ``tests/test_docs.py`` fails when a block is stale.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from trl_credit import hookspecs, plugin

__all__ = ["generated_blocks", "hook_block", "members_block", "update"]

_NOTE = "<!-- generated from {source}: edit it there, then run `python -m trl_credit.app.docs` -->"


def signature(hook: str) -> str:
    """``def <hook>(self, <args>) -> <return>`` exactly as a plugin writes it."""
    sig = inspect.signature(getattr(hookspecs, hook))
    args = ", ".join(["self", *sig.parameters])
    ret = sig.return_annotation
    ret = ret if isinstance(ret, str) else getattr(ret, "__name__", str(ret))
    return f"def {hook}({args}) -> {ret}"


def _render_docstring(doc: str) -> str:
    """reST fields (``:param x:``, ``:return:``) as a Markdown list; other lines as they are."""
    lines, out, field = inspect.cleandoc(doc).splitlines(), [], False
    for line in lines:
        match = re.match(r":param (\w+):\s*(.*)", line)
        if match:
            out.append(f"- **`{match.group(1)}`**: {match.group(2)}")
            field = True
        elif line.startswith(":return:"):
            out.append(f"- **returns**: {line[len(':return:'):].strip()}")
            field = True
        elif field and line.startswith("    "):
            out[-1] += " " + line.strip()
        else:
            if field and line.strip():
                out.append("")  # a paragraph after the field list
            field = False
            out.append(line)
    return _markdown("\n".join(out).strip())


def _markdown(text: str) -> str:
    """reST inline literals (double backticks) as Markdown ones."""
    return text.replace("``", "`")


def hook_block(hook: str) -> str:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    return "\n".join([_NOTE.format(source=f"the `{hook}` hookspec in trl_credit/hookspecs.py"), "",
                      "```python", "@hookimpl", signature(hook), "```", "", _render_docstring(doc)])


def members_block() -> str:
    """The reST simple table of `trl_credit.plugin`'s docstring as a Markdown table, with the text around it."""
    lines = (inspect.getdoc(plugin) or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("===")]
    spans = [m.span() for m in re.finditer(r"=+", lines[rules[0]])]

    def cells(line: str) -> list[str]:
        ends = [start for start, _ in spans[1:]] + [len(line) + 1]
        return [line[start:end].strip() for (start, _), end in zip(spans, ends)]

    header = cells(lines[rules[0] + 1])
    body = [cells(line) for line in lines[rules[1] + 1: rules[2]] if line.strip()]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in body]
    intro = "\n".join(lines[2: rules[0]]).strip()
    outro = "\n".join(lines[rules[2] + 1:]).strip()
    return _markdown("\n".join([_NOTE.format(source="the `trl_credit.plugin` module docstring"), "", intro, "", *md,
                                "", outro]))


def generated_blocks() -> dict[str, str]:
    blocks = {f"hook {hook}": hook_block(hook) for hook in hookspecs.HOOKS}
    blocks["plugin members"] = members_block()
    return blocks


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- BEGIN generated: {re.escape(name)} -->\n)(.*?)(<!-- END generated: {re.escape(name)} -->)",
                      re.S)


def update(text: str) -> tuple[str, list[str]]:
    """``text`` with every generated block refreshed; also the names whose markers are missing."""
    missing = []
    for name, block in generated_blocks().items():
        pattern = _pattern(name)
        if not pattern.search(text):
            missing.append(name)
            continue
        text = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(3), text)
    return text, missing


def main(argv: list[str] | None = None) -> int:
    path = Path(argv[0] if argv else "docs/hooks.md")
    text, missing = update(path.read_text(encoding="utf-8"))
    path.write_text(text, encoding="utf-8")
    if missing:
        print(f"{path}: no markers for {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"{path}: generated blocks up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
