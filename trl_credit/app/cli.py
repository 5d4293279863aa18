"""``trl-credit``: train, eval, plugins, validate, new-plugin, install."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from trl_credit.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-credit", description="Credit-assignment plugins for TRL's GRPOTrainer.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train with a `trl grpo` YAML config plus a `plugins:` list")
    p.add_argument("config")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="`--key value` overrides, as with `trl grpo`")

    p = sub.add_parser("eval", help="greedy accuracy and pass@k of a trained output dir (or a config's base model)")
    p.add_argument("target", metavar="CONFIG_OR_OUTPUT_DIR",
                   help="an output dir written by `trl-credit train`, or a config (evaluates its base model)")
    p.add_argument("--split", default="test", help="dataset split (default: test, the held-out split)")
    p.add_argument("--samples", type=int, default=None, help="evaluate the first N prompts (default: all)")
    p.add_argument("--k", default="1", help="pass@k for these k, comma-separated (default: 1)")
    p.add_argument("--n", type=int, default=None,
                   help="samples per prompt for pass@k (default: the config's num_generations, at least "
                        "max k; 0: greedy only)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="where to write the JSON (default: <output_dir>/eval_<split>[_base].json)")
    p.add_argument("--base", action="store_true", help="evaluate the base model, not the trained adapter")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the config's heldout_max_new_tokens (as train's held-out accuracy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences generated at once")
    p.add_argument("--threshold", type=float, default=1.0,
                   help="a sample is correct when its verifier reward is >= this")
    p.add_argument("--device", default="auto", help="auto (cuda unless the config says use_cpu), cpu, cuda, ...")

    p = sub.add_parser("validate", help="check a config (YAML, TRL keys, plugins, options, columns) without loading a model")
    p.add_argument("config")
    p.add_argument("overrides", nargs=argparse.REMAINDER)

    p = sub.add_parser("plugins", help="list installed plugins; `plugins show NAME` for one")
    p.add_argument("action", nargs="?", choices=["show"])
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="include the built-in plugins")

    from trl_credit.app.new_plugin import HOOK_CHOICES

    p = sub.add_parser("new-plugin", help="write a plugin package skeleton whose tests pass")
    p.add_argument("name", help="YAML handle, e.g. my_method")
    p.add_argument("--hook", default="compute_advantages", choices=HOOK_CHOICES,
                   help="the hook the skeleton implements (default: compute_advantages)")
    p.add_argument("--dir", default=None, help="parent folder (default: ./plugins if it exists, else .)")

    p = sub.add_parser("install", help="install a plugin: the monorepo's plugins/trl-credit-NAME, else PyPI")
    p.add_argument("name")

    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            from trl_credit.app.train_command import NothingTrained, dump, train

            try:
                metrics = train(args.config, _overrides(args.overrides))
            except NothingTrained as exc:
                print(f"trl-credit: {exc}", file=sys.stderr)
                return 1
            except (SystemExit, KeyboardInterrupt) as exc:  # never exit 0 without a trained model
                what = f"SystemExit({exc.code!r})" if isinstance(exc, SystemExit) else "KeyboardInterrupt"
                print(f"trl-credit: training was stopped by {what} (raised by a reward function, a plugin or the "
                      "user); the run did not finish and no final model was saved", file=sys.stderr)
                return 130 if isinstance(exc, KeyboardInterrupt) else 1
            if metrics.get("is_main_process", True):
                print(dump(metrics))
        elif args.command == "eval":
            return _eval(args)
        elif args.command == "validate":
            from trl_credit.app.train_command import validate

            cfg = validate(args.config, _overrides(args.overrides))
            print(f"{args.config}: OK; plugins in call order: {', '.join(cfg.plugins.names) or 'none'}")
        elif args.command == "plugins":
            return _plugins(args)
        elif args.command == "new-plugin":
            from trl_credit.app.new_plugin import new_plugin

            target = Path(args.dir) if args.dir else (Path("plugins") if Path("plugins").is_dir() else Path("."))
            path = new_plugin(args.name, target, hook=args.hook)
            print(f"created {path}\nnext: pip install -e {path} && pytest {path}/tests")
        elif args.command == "install":
            return _install(args.name)
    except ConfigError as exc:
        print(f"trl-credit: configuration error(s):\n{exc}", file=sys.stderr)
        return 2
    return 0


def _eval(args) -> int:
    from trl_credit.app.eval_command import format_table, parse_ks, run_eval

    try:
        ks = parse_ks(args.k)
    except ValueError as exc:
        print(f"trl-credit eval: {exc}", file=sys.stderr)
        return 2
    result = run_eval(args.target, split=args.split, samples=args.samples, ks=ks, n=args.n, json_path=args.json,
                      base=args.base, max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
                      threshold=args.threshold, device=args.device)  # fmt: skip
    print(format_table(result))
    return 0


def _overrides(values: list[str]) -> list[str]:
    return [v for v in values if v != "--"]


def _describe(info, with_config: bool = True) -> dict:
    from trl_credit.plugins import implemented_hooks

    entry = {"name": info.name, "version": info.version, "package": info.distribution,
             "object": info.value, "builtin": info.builtin}
    try:
        cls = info.load()
    except Exception as exc:  # listing shows a broken plugin instead of failing
        entry["error"] = f"{type(exc).__name__}: {exc}"
        return entry
    entry["hooks"] = implemented_hooks(cls)
    entry["summary"] = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
    if with_config and getattr(cls, "Config", None) is not None:
        entry["config"] = {  # under the key the YAML takes (an alias such as `lambda` for `lambda_`)
            (f.alias or name): {"type": _type_name(f.annotation),
                                "default": None if f.is_required() else f.get_default(call_default_factory=True),
                                "description": f.description or ""}
            for name, f in cls.Config.model_fields.items()
        }
    return entry


def _type_name(annotation) -> str:
    import typing

    if typing.get_origin(annotation) is None and hasattr(annotation, "__name__"):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _plugins(args) -> int:
    from trl_credit.plugins import available

    found = available(include_builtins=True)
    if args.action == "show":
        if not args.name or args.name not in found:
            from trl_credit.config import unknown_plugin_message

            print(unknown_plugin_message(0, args.name or "?", found).split(": ", 1)[1], file=sys.stderr)
            return 2
        entry = _describe(found[args.name])
        if args.json:
            print(json.dumps(entry, indent=2, default=str))
            return 0
        print(f"{entry['name']} {entry['version'] or ''} ({entry['package']}, {entry['object']})")
        if "error" in entry:
            print(f"  BROKEN: {entry['error']}")
            return 1
        print(f"  {entry['summary']}\n  hooks: {', '.join(entry['hooks'])}")
        for name, field in entry.get("config", {}).items():
            print(f"  {name}: {field['type']} = {field['default']!r}  {field['description']}")
        return 0
    from trl_credit.plugins import entry_point_problems

    for problem in entry_point_problems().values():
        print(f"trl-credit: warning: {problem}", file=sys.stderr)
    entries = [_describe(info, with_config=args.json) for info in found.values() if args.all or not info.builtin]
    entries.sort(key=lambda e: e["name"])
    if args.json:
        print(json.dumps(entries, indent=2, default=str))
        return 0
    if not entries:
        print("no plugins installed (try `trl-credit install dynamic_sampling`)")
    for e in entries:
        hooks = e.get("error") and f"BROKEN: {e['error']}" or ", ".join(e["hooks"])
        print(f"{e['name']:<24} {e['package'] or '':<32} {e['version'] or '':<10} {hooks}")
    return 0


PLUGIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def _install(name: str) -> int:
    """Install plugin ``name``: ``plugins/trl-credit-NAME`` of this repository, else ``trl-credit-NAME`` from
    the package index once it is found there. Only plugin names reach pip: no paths, versions or URLs."""
    if not PLUGIN_NAME.fullmatch(name):
        print(f"trl-credit install: {name!r} is not a plugin name (letters, digits, '-' and '_' only; "
              "no paths, versions or URLs)", file=sys.stderr)
        return 2
    dist = "trl-credit-" + name.replace("_", "-").lower()
    local = {}
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "plugins").is_dir():
            local.update({p.name: p for p in (root / "plugins").iterdir() if (p / "pyproject.toml").exists()})
    if dist in local:
        cmd = [sys.executable, "-m", "pip", "install", "-e", str(local[dist])]
    else:
        found = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist], capture_output=True,
                               text=True)
        if found.returncode != 0:
            import difflib

            close = difflib.get_close_matches(dist, list(local), n=1)
            hint = f" Did you mean '{close[0].removeprefix('trl-credit-').replace('-', '_')}'?" if close else ""
            print(f"trl-credit install: no plugin {name!r}: {dist} is neither in this repository's plugins/ nor "
                  f"on the package index.{hint}", file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "pip", "install", dist]
    print("+ " + " ".join(cmd))
    return subprocess.call(cmd, env={**os.environ})


if __name__ == "__main__":
    sys.exit(main())
