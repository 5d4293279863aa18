"""Turn credit on the bundled multi-turn task: outcome-only GRPO against each turn plugin that applies (issue #15).

Every run is `examples/multiturn.yaml` (guess 1..6 in 3 turns on the embedded model, LoRA, 20 steps) with
its seed and, for a plugin, that plugin's entry added. It measures greedy held-out success and the turns per
game, before and after training. Each run stores one JSON under ``benchmarks/results/multiturn/guess-<max>x<turns>/runs/``, and a
finished run is skipped, so the grid resumes where it stopped. The runs evaluate only after training: "before" is
the base model's play, the same for every run, measured once into ``base.json`` there. ``--report`` writes the table into
docs/results.md (between its markers) from the runs finished so far, with paired differences against GRPO
on the same seeds.

    python benchmarks/multiturn.py --seeds 3                      # GRPO and every plugin below, 3 seeds
    python benchmarks/multiturn.py --variants grpo,progress_potential --seeds 0,1
    python benchmarks/multiturn.py --report
    python benchmarks/multiturn.py --play runs/multiturn/salt/seed0/out   # what a trained policy says, game by game
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from learning import _ci, parse_seeds, stats, update_docs  # noqa: E402  (the learning benchmark's statistics)

EXAMPLE = ROOT / "examples" / "multiturn.yaml"


def game_of(config: dict[str, Any]) -> dict[str, int]:
    """The example's game: ``max_value`` and ``turns`` from its ``dataset_name: guess:...``."""
    from trl_credit.app.data import parse_arithmetic_spec

    name, _, spec = str(config["dataset_name"]).partition(":")
    options = parse_arithmetic_spec(spec)
    if name != "guess":
        raise SystemExit(f"{EXAMPLE} does not play the guess game: dataset_name {config['dataset_name']!r}")
    return {"max_value": int(options.get("max_value", 5)), "turns": int(options.get("turns", 3))}


GAME = game_of(yaml.safe_load(EXAMPLE.read_text()))
CAP = GAME["max_value"]  # guess_distance is capped at max_value: the distance before any guess
#: one folder per game, so a change of the example's game never mixes its runs with an earlier game's
OUT = HERE / "results" / "multiturn" / f"guess-{GAME['max_value']}x{GAME['turns']}"
MARKERS = ("<!-- multiturn-results:begin -->", "<!-- multiturn-results:end -->")
#: variant -> plugin entries (the guess game records guess_distance per turn: lower is better, capped at CAP)
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "grpo": [],
    "progress_potential": [{"name": "progress_potential", "column": "guess_distance", "direction": "lower",
                            "initial": CAP, "terminal": "last"}],
    "ctc_grpo": [{"name": "ctc_grpo", "column": "guess_distance", "direction": "lower", "initial": CAP}],
    "turn_baseline": [{"name": "turn_baseline"}],
    "stage_norm": [{"name": "stage_norm"}],
    "salt": [{"name": "salt"}],
    "empg": [{"name": "empg"}],
    "mira": [{"name": "mira", "column": "guess_distance", "values": "distance", "thresholds": [1, 0]}],
    # the masked reply keeps the game's ChatML wrap (as GuessRollout renders a reply), only its words are hidden
    # (written out: the grid's first runs predate keep_wrap, which derives almost the same context by itself)
    "infopo": [{"name": "infopo", "keep_wrap": False,
                "mask_text": "\n<|im_start|>user\n[feedback hidden]<|im_end|>\n<|im_start|>assistant\n"}],
    # guess_solved reads the rollout's outcome: probes are judged by their last number against the secret
    "taco": [{"name": "taco", "score": "answer", "num_samples": 4, "max_new_tokens": 6}],
    # the gold answer is the secret, read where the next guess begins (after "<|im_start|>assistant\n"): no cue
    "igpo": [{"name": "igpo", "segments": "turns", "cue": ""}],
    "trace": [{"name": "trace", "segments": "turns", "cue": "", "template": "{answer}"}],
    # no gold: the group's final guesses are the answer clusters, read where the next guess begins
    "siop": [{"name": "siop", "segments": "turns", "cue": ""}],
    # success probability of a history: the mean outcome of the group's trajectories that share it (no pass)
    "pica": [{"name": "pica", "potential": "prefix"}],
}
#: turn plugins that do not apply to the game (no tools, no gold calls)
NOT_APPLICABLE = {"fatal_aware": "needs tool calls (the game has none)",
                  "matchtir": "needs tool calls and gold calls (the game has none)",
                  "procredit": "its one acceptance check (the right number) is the outcome itself",
                  "skillgate": "needs skill reads (named spans) and gold skills (the game has none)"}


def result_path(out: Path, label: str, seed: int) -> Path:
    return out / "runs" / label / f"seed{seed}.json"


def config_of(label: str, seed: int, output_dir: str) -> dict[str, Any]:
    config = yaml.safe_load(EXAMPLE.read_text())
    config.update({"seed": seed, "output_dir": output_dir, "plugins": VARIANTS[label], "heldout_before": False})
    return config


#: config keys that change neither training nor the held-out evaluation (where a run wrote its files; whether it
#: also evaluated before training, which the grid's first runs did)
NEUTRAL = ("output_dir", "heldout_before")


def stale_keys(run: dict[str, Any]) -> list[str]:
    """The config keys in which a stored run differs from the run the grid would make now ([] when it is the same
    setting): a changed example, game option or plugin entry must not mix its runs with older ones."""
    want = config_of(run["label"], run["seed"], "")
    have = run.get("config") or {}
    return sorted(k for k in set(want) | set(have) if k not in NEUTRAL and want.get(k) != have.get(k))


def plugin_cost(steps: list[dict[str, Any]], plugins: list[str]) -> float | None:
    """Median over steps (the first left out) of the plugins' hook time, extra passes included, over the step's
    generation time (``trl_credit/<plugin>/seconds`` / ``trl_credit/cost/generation_seconds``)."""
    ratios = []
    for h in steps[1:] or steps:
        generation = h.get("trl_credit/cost/generation_seconds")
        spent = [h.get(f"trl_credit/{name}/seconds") for name in plugins]
        if generation and spent and all(x is not None for x in spent):
            ratios.append(sum(spent) / generation)
    return round(statistics.median(ratios), 3) if ratios else None


def run_one(label: str, seed: int, out: Path, work: Path) -> dict[str, Any]:
    from trl_credit.app.train_command import train

    folder = work / label / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    config = config_of(label, seed, str(folder / "out"))
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    base = base_play(out, config)  # before training: the same for every run (see base_play)
    return record(label, seed, config, train(str(path)), out, base)


def measure_feedback(out: Path) -> list[str]:
    """Add `feedback_use` before and after to finished runs that predate it, from the LoRA adapter each run saved
    in its ``output_dir`` (the base model for "before"), and their median step time from the ``metrics.json``
    there. Returns one line per run: measured, or why not."""
    lines: list[str] = []
    bases: dict[tuple, dict[str, Any]] = {}
    for path in sorted((out / "runs").glob("*/seed*.json")):
        run = json.loads(path.read_text())
        before = dict(run)
        folder = Path(run["config"]["output_dir"])
        if not run.get("median_step_seconds") and (folder / "metrics.json").exists():
            history = json.loads((folder / "metrics.json").read_text()).get("log_history", [])
            run["median_step_seconds"] = median_step_seconds([h for h in history if "loss" in h])
        if "feedback_after" not in run:
            if (folder / "adapter_model.safetensors").exists():
                _measure(run, folder, bases)
                lines.append(f"{path.parent.name}/{path.name}: follows {run['feedback_after']['follows']:.3f}")
            else:
                lines.append(f"{path.parent.name}/{path.name}: no adapter in {folder}: not measured")
        if run != before:
            path.write_text(json.dumps(run, indent=1) + "\n")
    return lines


def _measure(run: dict[str, Any], folder: Path, bases: dict[tuple, dict[str, Any]]) -> None:
    """``run``'s `feedback_use` before (its base model, measured once per model and held-out set in ``bases``) and
    after (the adapter in ``folder``), on the held-out games its config evaluated."""
    from peft import PeftModel

    from trl_credit.app.guess import feedback_use

    base, tokenizer, heldout, game, key = _load(run["config"])
    if key not in bases:
        bases[key] = feedback_use(base, tokenizer, heldout, **game)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    run.update(feedback_before=bases[key], feedback_after=feedback_use(model, tokenizer, heldout, **game))


def _load(config: dict[str, Any]) -> tuple[Any, Any, Any, dict[str, Any], tuple]:
    """A run config's base model (fresh: PEFT wraps it in place), tokenizer, held-out games and the game's rollout
    options (`rollout_options`: turn length, strict), and the key that names them (model, dataset, number of
    held-out games)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_credit.app.data import load_train_eval, parse_arithmetic_spec
    from trl_credit.app.guess import rollout_options
    from trl_credit.app.models import resolve_model

    name = resolve_model(str(config["model_name_or_path"]))
    spec, extra = str(config["dataset_name"]), config.get("dataset_config")
    # as `trl-credit train` reads them: the ``:`` suffix over ``dataset_config``
    game = rollout_options({**parse_arithmetic_spec(extra), **parse_arithmetic_spec(spec.partition(":")[2])})
    heldout = load_train_eval(spec, extra)[1]
    heldout = heldout.select(range(min(int(config.get("heldout_samples") or len(heldout)), len(heldout))))
    base = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    return base, AutoTokenizer.from_pretrained(name), heldout, game, (name, spec, len(heldout))


def base_play(out: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The base model's greedy held-out play: ``success``, ``turns`` and ``feedback`` (`feedback_use`), measured once
    per model and held-out set and kept in ``out/base.json``. It is every run's "before", whatever its seed or
    plugin: LoRA starts as the identity and greedy decoding is deterministic, so the runs skip that evaluation
    (``heldout_before: false``; about 70-85 s each here)."""
    path = out / "base.json"
    key = [str(config["model_name_or_path"]), str(config["dataset_name"]), config.get("heldout_samples")]
    if config.get("dataset_config"):  # the key of the grid's existing base.json has no such entry
        key.append(str(config["dataset_config"]))
    kept = json.loads(path.read_text()) if path.exists() else {}
    if kept.get("key") == key:
        return kept
    from trl_credit.app.guess import feedback_use, guess_success

    base, tokenizer, heldout, game, _ = _load(config)
    play = {"key": key, **guess_success(base, tokenizer, heldout, **game),
            "feedback": feedback_use(base, tokenizer, heldout, **game)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(play, indent=1) + "\n")
    return play


def greedy_play(folder: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    """What the policy saved in ``folder`` (a LoRA adapter; none: the base model) says in each held-out game of
    ``config``, played greedily as the held-out evaluation plays it: per game its ``secret``, the text of each
    model ``turns`` (its guess: `trl_credit.app.guess.guess_of`) and whether it was ``solved``."""
    from itertools import groupby

    from trl_credit.app.guess import greedy_games, parse_game, target_of

    model, tokenizer, heldout, options, _ = _load(config)
    if (folder / "adapter_model.safetensors").exists():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(folder)).eval()
    prompts = list(heldout["prompt"])
    out = greedy_games(model, tokenizer, heldout, **options)
    games = []
    for prompt, ids, mask, solved in zip(prompts, out["completion_ids"], out["env_mask"], out["guess_solved"]):
        runs = groupby(zip(ids, mask), key=lambda pair: pair[1])  # alternating model turns (1) and replies (0)
        turns = [tokenizer.decode([i for i, _ in run], skip_special_tokens=True).strip() for own, run in runs if own]
        game, max_value, _ = parse_game(prompt)
        games.append({"secret": target_of(game, max_value), "turns": turns, "solved": bool(solved)})
    return games


def play_lines(games: list[dict[str, Any]]) -> list[str]:
    """One line per distinct (secret, turns, solved), by secret and, within a secret, most frequent first:
    ``count x secret k: t1 | t2 | t3 (won)``."""
    from collections import Counter

    counts = Counter((g["secret"], tuple(g["turns"]), g["solved"]) for g in games)
    return [f"{n} x secret {secret}: {' | '.join(turns)} ({'won' if solved else 'lost'})"
            for (secret, turns, solved), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1]))]


def median_step_seconds(steps: list[dict[str, Any]]) -> float | None:
    """Median of TRL's per-step ``step_time``: unlike the mean, a few steps slowed by another job barely move it."""
    times = [h["step_time"] for h in steps if isinstance(h.get("step_time"), (int, float))]
    return round(statistics.median(times), 2) if times else None


def code_version() -> str | None:
    """The commit the run's code came from (abbreviated hash; "-dirty" when the host, a plugin, an example or a
    benchmark script differs from it: docs and results written by the grid itself do not count), so runs of one
    grid made by different versions of the host can be told apart. None outside a git checkout."""
    code = ["trl_credit", "plugins", "examples", "benchmarks/*.py"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        edited = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *code], cwd=ROOT, timeout=10).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if edited else "")) if head else None


def record(label: str, seed: int, config: dict[str, Any], metrics: dict[str, Any], out: Path,
           base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Store one finished run (``metrics``: what `train` returns, or its ``metrics.json``) as the grid's result.
    With ``base`` (`base_play`) the run evaluated only after training, and "before" is the base model's play."""
    steps = [h for h in metrics["log_history"] if "loss" in h]
    feedback = metrics.get("heldout_feedback") or []  # one `feedback_use` per held-out evaluation, when recorded
    if base is None:  # the run evaluated before training too
        base = {"success": metrics["heldout_accuracy_before"], "turns": metrics["heldout_turns"][0],
                "feedback": feedback[0] if feedback else None}
    result = {"label": label, "seed": seed, "plugins": VARIANTS[label], "config": config,
              "before": base["success"], "after": metrics["heldout_accuracy_after"],
              "turns_before": base["turns"], "turns_after": metrics["heldout_turns"][-1],
              "seconds_per_step": metrics["seconds_per_step"], "steps": len(steps),
              "median_step_seconds": median_step_seconds(steps),
              **({"feedback_before": base["feedback"], "feedback_after": feedback[-1]} if feedback else {}),
              "train_reward": [round(h.get("rewards/guess_reward/mean", float("nan")), 4) for h in steps],
              "plugin_x_generation": plugin_cost(steps, [p["name"] for p in VARIANTS[label]]),
              "code": code_version()}
    target = result_path(out, label, seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1) + "\n")
    return result


def step_cell(runs: list[dict[str, Any]]) -> str:
    """Median over seeds of each run's median step time, over the runs that recorded it (one run that shared the
    machine with another job for its whole length moves neither); when none did (runs from before it was
    recorded), the mean step time, marked * (it includes whatever else ran on the machine)."""
    medians = [r["median_step_seconds"] for r in runs if r.get("median_step_seconds")]
    if medians:
        return f"{statistics.median(medians):.1f}"
    return f"{statistics.mean(r['seconds_per_step'] for r in runs):.1f}*"


def follows_cell(runs: list[dict[str, Any]]) -> str:
    """Mean `feedback_use` ``follows`` after training over the seeds that measured it (how many, when not all)."""
    values = [r["feedback_after"]["follows"] for r in runs if r.get("feedback_after")]
    if not values:
        return "-"
    return f"{statistics.mean(values):.3f}" + (f" ({len(values)} of {len(runs)} seeds)" if len(values) < len(runs) else "")


def cost_cell(values: list[float | None], label: str) -> str:
    known = [v for v in values if v is not None]
    if not VARIANTS[label]:
        return "-"
    return f"{statistics.mean(known):.2f}x" if known else "not recorded"


def late_success(run: dict[str, Any]) -> float | None:
    """Mean sampled training success over the run's last 10 steps (the policy's own play, not greedy)."""
    values = [x for x in (run.get("train_reward") or [])[-10:] if x == x]
    return sum(values) / len(values) if values else None


def report(out: Path) -> str:
    runs: dict[str, dict[int, dict]] = {}
    stale = []
    for path in sorted((out / "runs").glob("*/seed*.json")):
        run = json.loads(path.read_text())
        if run.get("label") not in VARIANTS or stale_keys(run):
            stale.append(f"{path.parent.name}/{path.stem}")
            continue
        runs.setdefault(run["label"], {})[run["seed"]] = run
    base = runs.get("grpo", {})
    lines = ["| variant | seeds | success before | success after | turns per game after | Δ success vs GRPO "
             "(paired, 95% CI) | Δ turns vs GRPO | s/step (median) | plugin time / generation time | sampled training success, "
             "last 10 steps | Δ sampled training success vs GRPO | 2nd guess follows the feedback, after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in VARIANTS:
        done = runs.get(label, {})
        if not done:
            lines.append(f"| `{label}` | 0 | - | - | - | - | - | - | - | - | - | not run yet (the grid is resumable) |")
            continue
        seeds = sorted(done)
        after, turns = stats([done[s]["after"] for s in seeds]), stats([done[s]["turns_after"] for s in seeds])
        paired = [s for s in seeds if s in base] if label != "grpo" else []
        d_after = stats([done[s]["after"] - base[s]["after"] for s in paired])
        d_turns = stats([done[s]["turns_after"] - base[s]["turns_after"] for s in paired])
        trained = [s for s in paired if late_success(done[s]) is not None and late_success(base[s]) is not None]
        d_trained = stats([late_success(done[s]) - late_success(base[s]) for s in trained])
        late = [x for x in (late_success(done[s]) for s in seeds) if x is not None]

        def f(x: dict[str, Any]) -> str:
            return "-" if x["n"] == 0 else _ci(x) + (" (one seed)" if x["n"] == 1 else "")

        before = stats([done[s]["before"] for s in seeds])["mean"]
        spread = (f" ± {after['ci95']:.3f}" if after["ci95"] is not None else
                  f" (no spread over {after['n']})" if after["n"] > 1 else "")
        lines.append(f"| `{label}` | {len(seeds)} | {before:.3f} | {after['mean']:.3f}{spread} | {turns['mean']:.2f} "
                     f"| {f(d_after) if paired else '-'} | {f(d_turns) if paired else '-'} "
                     f"| {step_cell([done[s] for s in seeds])} "
                     f"| {cost_cell([done[s].get('plugin_x_generation') for s in seeds], label)} "
                     f"| {f'{statistics.mean(late):.3f}' if late else '-'} | {f(d_trained) if trained else '-'} "
                     f"| {follows_cell([done[s] for s in seeds])} |")
    lines += ["", "Not applicable to the game: " + "; ".join(f"`{k}` ({v})" for k, v in NOT_APPLICABLE.items()) + "."]
    if stale:
        lines += ["", f"Left out: {', '.join(stale)} (made with another setting than the grid's; rerun them)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants (default: all)")
    parser.add_argument("--seeds", default="3", help="N (seeds 0..N-1) or a comma list")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--work", default=str(ROOT / "runs" / "multiturn"))
    parser.add_argument("--report", action="store_true", help="train nothing: write the table into docs/results.md")
    parser.add_argument("--feedback", action="store_true", help="train nothing: measure `feedback_use` on the "
                        "saved adapters of finished runs that predate it (and their median step time), then report")
    parser.add_argument("--play", metavar="OUTPUT_DIR", help="train nothing: print what the adapter a run saved in "
                        "OUTPUT_DIR says in each held-out game (greedy); a folder without one: the base model")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "results.md"))
    args = parser.parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    if args.play:
        print("\n".join(play_lines(greedy_play(Path(args.play), config_of("grpo", 0, args.play)))))
        return
    if args.feedback:
        print("\n".join(measure_feedback(out)))
    elif not args.report:
        seeds = parse_seeds(args.seeds)
        labels = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in labels if v not in VARIANTS]
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
        for seed in seeds:  # seed-major: every variant of seed 0 first, so a partial grid is paired
            for label in labels:
                path = result_path(out, label, seed)
                if path.exists():
                    changed = stale_keys(json.loads(path.read_text()))
                    if not changed:
                        continue
                    print(f"[multiturn] {label} seed {seed}: the stored run differs in {', '.join(changed)}: "
                          "training it again", flush=True)
                clock = time.time()
                try:
                    result = run_one(label, seed, out, work)
                except Exception as exc:  # noqa: BLE001 - one failed run must not stop a night's grid
                    print(f"[multiturn] {label} seed {seed}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                    continue
                print(f"[multiturn] {label} seed {seed}: success {result['before']:.3f} -> {result['after']:.3f}, "
                      f"turns {result['turns_after']:.2f} ({time.time() - clock:.0f} s)", flush=True)
    text = report(out)
    if args.docs:
        command = " ".join(["python benchmarks/multiturn.py", *(argv if argv is not None else sys.argv[1:])])
        update_docs(Path(args.docs), text + f"\n\nGenerated by `{command}` on {time.strftime('%Y-%m-%d')} (every "
                    "finished run of the grid's setting; `--report` regenerates it without training).", MARKERS)
    print(text)


if __name__ == "__main__":
    main()
