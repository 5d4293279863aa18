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
    assert "## State and checkpoints" in text and "## Plugin members" in text


def test_hook_reference_is_generated_from_the_hookspecs():
    """docs/hooks.md's per-hook blocks and members table are exactly what the hookspecs generate."""
    from trl_credit.app.docs import signature, update

    text = (DOCS / "hooks.md").read_text(encoding="utf-8")
    fresh, missing = update(text)
    assert not missing, f"docs/hooks.md has no generated block for {missing}"
    assert fresh == text, "docs/hooks.md is stale: run `python -m trl_credit.app.docs`"
    for hook in HOOKS:
        assert signature(hook) in text  # every hook's signature, literally
        section = text.split(f"\n## {hook}\n", 1)[1].split("\n## ", 1)[0]
        assert signature(hook) in section, f"the '## {hook}' section does not show its own signature"


@pytest.mark.parametrize("doc", ["hooks.md", "tutorial.md", "configuration.md", "index.md"])
def test_docs_do_not_say_the_estimator_sees_kept_rows_only(doc):
    text = (DOCS / doc).read_text(encoding="utf-8").lower()
    for wrong in ("kept rows only", "`batch.kept` all true", "refill: true`", "refill: bool = true"):
        assert wrong not in text, f"docs/{doc} still says {wrong!r}"


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


@pytest.mark.parametrize("doc", ["configuration.md", "tutorial.md", "hooks.md", "index.md", "checks.md"])
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


# ---------------------------------------------------------------- YAML snippets


def _yaml_snippets() -> list[tuple[str, int, str]]:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(ROOT.glob("plugins/*/README.md"))]
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"^```yaml\n(.*?)^```", text, re.M | re.S):
            found.append((str(page.relative_to(ROOT)), text[: match.start()].count("\n") + 1, match.group(1)))
    return found


def _tutorial_plugin():
    """The tutorial's MyNegativeOnly, executed from its code block (so the tutorial's code is tested too)."""
    text = (DOCS / "tutorial.md").read_text(encoding="utf-8")
    code = next(b for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if "class MyNegativeOnly" in b)
    namespace: dict = {"__name__": "trl_credit_my_negative_only"}
    exec(compile(code, "docs/tutorial.md", "exec"), namespace)  # noqa: S102 (our own documentation)
    return namespace["MyNegativeOnly"]


class _Defined:
    """An `Available` stand-in for a plugin defined in the docs themselves."""

    def __init__(self, name, cls):
        self.name, self.value, self.distribution, self.version, self.builtin = name, name, "docs", None, False
        self.cls = cls

    def load(self):
        return self.cls


@pytest.mark.parametrize("page, line, snippet", _yaml_snippets(), ids=lambda v: v if isinstance(v, str) else "")
def test_yaml_snippets_validate(page, line, snippet, tmp_path, monkeypatch):
    """Every YAML block in README.md, docs/ and the plugin READMEs is a config `trl-credit validate` accepts
    (a fragment is validated on top of a minimal run; the tutorial's plugin is defined by its own code)."""
    import yaml

    from trl_credit import config as config_module
    from trl_credit.app.train_command import validate
    from trl_credit.plugins import available

    data = yaml.safe_load(snippet)
    if isinstance(data, list):  # a fragment of a plugins: list
        data = {"plugins": data}
    assert isinstance(data, dict), f"{page}:{line}: not a YAML mapping"
    # `my_pkg.<module>.<func>`: the docs' placeholder for the user's own reward functions
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module in ("rewards", "judges"):
        (package / f"{module}.py").write_text(
            "def __getattr__(name):\n"
            "    def reward(completions, **kwargs):\n"
            "        return [0.0] * len(completions)\n"
            "    reward.__name__ = name\n"
            "    return reward\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # `runs/prime/checkpoint-200/tc_prime_prm`: the docs' placeholder for a saved adapter (what prime writes)
    saved = tmp_path / "saved_prm"
    saved.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (saved / name).write_text("{}")
    for entry in data.get("plugins") or []:
        if isinstance(entry, dict) and entry.get("path") == "runs/prime/checkpoint-200/tc_prime_prm":
            entry["path"] = str(saved)
    installed = {**available(), "my_negative_only": _Defined("my_negative_only", _tutorial_plugin())}
    monkeypatch.setattr(config_module, "available", lambda include_builtins=True: installed)
    # a fragment runs on the user's own dataset (a hub id: its columns are not checked offline)
    base = {"dataset_name": "my-org/my-dataset", "use_cpu": True, "output_dir": str(tmp_path / "out"),
            "model_name_or_path": "smollm2-135m-instruct", "use_peft": True}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({**base, **data}))
    try:
        validate(str(run))
    except config_module.ConfigError as exc:
        pytest.fail(f"{page}:{line}: the YAML snippet does not validate:\n{exc}")
