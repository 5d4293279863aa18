"""Two processes on CPU give the same advantages as one process for the same samples."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plugins_for_tests as fx
from trl_credit.config import build_plugins
from trl_credit.testing import make_batch, run_plugin

HERE = Path(__file__).parent


# Every mode but ``resume`` in one launch, then ``resume`` in a fresh pair of processes (it must start from
# the checkpoint alone): starting two processes costs more than most modes' training. The module's tests share
# these two launches, so they run on one pytest-xdist worker (``--dist loadfile``: a module-scoped fixture is set
# up once per worker that runs one of its tests; under ``--dist load`` both workers would launch).
FIRST = ("pipeline", "curriculum", "augment", "adapter", "dense", "rollout", "tools", "environment", "resume-full",
         "resume-part")


def launch_two(out_dir: Path, modes: tuple[str, ...]) -> None:
    """Run distributed_worker.py on two CPU processes, in each of ``modes`` in turn (on a free port: without
    ``--dist loadfile`` two pytest-xdist workers may launch at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           str(HERE / "distributed_worker.py"), str(out_dir), ",".join(modes)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_model):
    """The two launches' folder; ``ranks(mode)`` reads a mode's per-rank records from it."""
    out = tmp_path_factory.mktemp("distributed")
    launch_two(out, FIRST)
    launch_two(out, ("resume",))
    return out


@pytest.fixture
def ranks(launched):
    return lambda mode: [torch.load(launched / f"{mode}-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_two_processes_match_one_process_on_the_same_samples(ranks):
    ranks = ranks("pipeline")
    assert [r["world"] for r in ranks] == [2, 2], "accelerate must really start two processes"
    steps0, steps1 = ranks[0]["records"], ranks[1]["records"]
    assert len(steps0) == len(steps1) == 2
    for a, b in zip(steps0, steps1):
        # every hook saw the same, whole, gathered batch on both ranks (3 groups of 4 split 6/6 over ranks)
        for key in ("completion_ids", "rewards", "kept", "advantages", "prompt_index"):
            assert torch.equal(a[key], b[key]), key
        assert a["prompts"] == b["prompts"] and a["rewards"].shape[0] == 12
        # each rank trained on its slice of the host's advantages
        full = a["advantages"]
        assert full.dim() == 2  # token-level credit
        assert torch.equal(a["local_advantages"], full[:6, : a["local_advantages"].shape[1]])
        assert torch.equal(b["local_advantages"], full[6:, : b["local_advantages"].shape[1]])
        # one process, same samples: the same plugins give the same advantages
        batch = make_batch(a["rewards"], num_generations=4, completion_ids=a["completion_ids"],
                           completion_mask=a["completion_mask"], pad_token_id=-1)
        plugins = build_plugins([{"name": fx.DropConstant, "max_refill_rounds": 4}, fx.TokenCredit])
        single = run_plugin(None, batch, plugins=plugins)
        assert torch.equal(single.keep, a["kept"])
        torch.testing.assert_close(single.advantages, full)
    rounds = [h["trl_credit/generation_rounds"] for h in ranks[0]["log_history"] if "trl_credit/generation_rounds" in h]
    assert rounds == [h["trl_credit/generation_rounds"] for h in ranks[1]["log_history"]
                      if "trl_credit/generation_rounds" in h]
    assert max(rounds) > 1, f"the fixture is built so that refill happens across processes: {rounds}"


@pytest.mark.distributed
def test_curriculum_draws_the_same_prompts_on_every_process(ranks):
    ranks = ranks("curriculum")
    assert [r["world"] for r in ranks] == [2, 2]
    steps0, steps1 = ranks[0]["records"], ranks[1]["records"]
    assert len(steps0) == len(steps1) == 4
    for a, b in zip(steps0, steps1):
        assert torch.equal(a["prompt_index"], b["prompt_index"])
        # 3 groups of 4 over 2 ranks x 6 rows: group 1 spans both ranks, so whole groups mean both
        # ranks drew the same prompts (each rank takes its slice of one shared draw)
        groups = a["prompt_index"].view(3, 4)
        assert (groups == groups[:, :1]).all(), groups
        assert len(set(groups[:, 0].tolist())) == 3  # distinct prompts per batch
    for key in ("seen", "passed", "reward_sum", "last_step"):  # statistics identical, and really updated
        assert torch.equal(ranks[0]["prompt_stats"][key], ranks[1]["prompt_stats"][key]), key
    assert ranks[0]["prompt_stats"]["seen"].sum() == 4 * 12


@pytest.mark.distributed
def test_resume_with_refill_is_exact_on_two_processes(ranks):
    """4 uninterrupted steps equal 2 + resume (fresh processes) + 2 on two processes: same prompts, rewards and
    losses."""
    full, first, second = ranks("resume-full"), ranks("resume-part"), ranks("resume")
    for rank in range(2):
        seen = [(r["prompt_index"].tolist(), r["rewards"].tolist()) for r in first[rank]["records"] + second[rank]["records"]]
        assert seen == [(r["prompt_index"].tolist(), r["rewards"].tolist()) for r in full[rank]["records"]]
        losses = {h["step"]: h["loss"] for run in (first, second) for h in run[rank]["log_history"] if "loss" in h}
        assert losses == pytest.approx({h["step"]: h["loss"] for h in full[rank]["log_history"] if "loss" in h},
                                       abs=1e-7)
    rounds = [h["trl_credit/generation_rounds"] for h in full[0]["log_history"] if "trl_credit/generation_rounds" in h]
    assert len(rounds) == 4 and max(rounds) > 1, rounds


@pytest.mark.distributed
def test_augmentation_and_loss_rows_on_two_processes(ranks):
    """Extra generation splits its requests over the ranks; every rank sees the same augmented batch, and
    each micro-batch's ``rows`` point at that rank's own completions."""
    ranks = ranks("augment")
    assert [r["world"] for r in ranks] == [2, 2]
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):
        assert a["completion_ids"].shape[0] == 20  # 3 groups + 2 hinted ones, 10 rows per rank
        assert a["augmented"] == b["augmented"] == [None] * 12 + ["hint"] * 8
        assert torch.equal(a["completion_ids"], b["completion_ids"]) and torch.equal(a["rewards"], b["rewards"])
        assert all(p[0]["content"] == "Hint: add." for p in a["prompts"][12:])
    for rank in ranks:
        assert len(rank["loss_checks"]) == 2 and all(rank["loss_checks"])
        logged = [h for h in rank["log_history"] if "loss" in h]
        assert [h["trl_credit/augmented_groups"] for h in logged] == [2.0, 2.0]
    assert ranks[0]["prompt_stats"]["seen"].sum() == 2 * 12  # hinted rollouts are not counted


@pytest.mark.distributed
def test_auxiliary_adapters_are_the_same_on_two_processes(ranks):
    ranks = ranks("adapter")
    assert [r["world"] for r in ranks] == [2, 2]
    a, b = ranks[0]["adapters"], ranks[1]["adapters"]
    prm = [n for n in a if ".tc_aux_prm_prm." in n]
    ema = [n for n in a if ".tc_aux_prm_ema." in n]
    assert prm and ema and a.keys() == b.keys()
    for name in a:  # the policy (DDP), the trained PRM (gradients summed by the host) and the EMA agree
        assert torch.equal(a[name], b[name]), name
    updates = [r["records"][-1]["updates"] for r in ranks]
    assert len(updates[0]) == 2
    for u0, u1 in zip(*updates):  # the same loss, grad norm and pre-step scores: the global mean
        assert u0["loss"] == u1["loss"] and u0["grad_norm"] == u1["grad_norm"] and torch.equal(u0["logps"], u1["logps"])
    assert all(u["loss"] > 0 and u["grad_norm"] > 0 and u["logps"].abs().sum() > 0 for u in updates[0])
    for p, e in zip(sorted(prm), sorted(ema)):
        assert not torch.equal(a[p], a[e])  # the PRM moved away from its start (= base) and the EMA followed the policy


@pytest.mark.distributed
def test_extra_scorers_are_collective_and_score_every_row_once(ranks):
    """prefix_logps, probe, score_texts and soft_values: each rank scores its own rows and the results are
    combined, so both ranks hold the same, complete values (no row missing, none counted twice)."""
    ranks = ranks("dense")
    assert [r["world"] for r in ranks] == [2, 2]
    steps = [[r for r in rank["records"] if "prefix" in r] for rank in ranks]
    assert len(steps[0]) == len(steps[1]) == 2
    for a, b in zip(*steps):
        for key in ("prefix", "scores", "q", "v", "policy"):
            assert torch.equal(a[key], b[key]), key
        assert torch.equal(a["probe"].tokens, b["probe"].tokens) and torch.equal(a["probe"].logps, b["probe"].logps)
        valid = a["ends"] >= 0
        scored = a["prefix"].abs().sum(-1)  # (N, K): every valid entry was scored (log-probs < 0), the rest is 0
        assert (scored[valid] > 0).all() and (scored[~valid] == 0).all()
        assert a["scores"][:, 0].tolist() == a["expected_scores"]  # the run's reward function, row for row
        mask = a["mask"].bool()
        torch.testing.assert_close((a["q"] - a["v"][:, :-1])[mask], a["policy"][mask], rtol=1e-4, atol=1e-4)
        assert (a["probe"].mask.sum(-1) > 0).all() and (a["probe"].logps <= 0).all()


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tools", "environment"])
def test_tool_and_environment_paths_on_two_processes(ranks, mode):
    """TRL's tool loop on each rank's own rows; every rank sees the same gathered turns, calls, failures and
    environment values, and each row's are what the script did for its prompt."""
    import math

    import scripted_tools as st

    ranks = ranks(mode)
    assert [r["world"] for r in ranks] == [2, 2]
    a_steps, b_steps = ranks[0]["records"], ranks[1]["records"]
    assert len(a_steps) == len(b_steps) == 2
    for a, b in zip(a_steps, b_steps):
        for key in ("count", "calls", "failures", "env", "completion_ids"):
            assert torch.equal(a[key], b[key]), key
        assert a["prompts"] == b["prompts"] and a["count"].numel() == 8  # 2 groups of 4, half on each rank
        for i, prompt in enumerate(a["prompts"]):
            calls, failures = st.expected_turns(st.conversation_text(prompt))
            assert int(a["count"][i]) == len(calls) and a["calls"][i, :len(calls)].tolist() == calls
            assert a["failures"][i, :len(calls)].tolist() == failures
            if mode == "environment":
                plan = st.plan_of(st.conversation_text(prompt))
                assert a["values"][i, plan - 1].item() == 5.0 if plan else math.isnan(a["values"][i, 0].item())
                assert torch.equal(a["values"].isnan(), b["values"].isnan())
    assert any(int(r["count"].max()) == 3 for r in a_steps)
    logged = [h for h in ranks[0]["log_history"] if "loss" in h]
    assert len(logged) == 2 and all(math.isfinite(h["loss"]) for h in logged)


@pytest.mark.distributed
def test_rollout_func_with_env_mask_on_two_processes(ranks):
    """TRL's third multi-turn path: each rank's ``rollout_func`` plays its own rows; every rank sees the same
    gathered turns and per-turn fields (refill included), and each row's are the ones its rollout returned."""
    ranks = ranks("rollout")
    assert [r["world"] for r in ranks] == [2, 2]
    a_steps, b_steps = ranks[0]["records"], ranks[1]["records"]
    assert len(a_steps) == len(b_steps) == 2
    for a, b in zip(a_steps, b_steps):
        for key in ("count", "env", "model", "completion_ids", "progress", "kept", "advantages"):
            assert torch.equal(a[key].nan_to_num(-1.0) if key == "progress" else a[key],
                               b[key].nan_to_num(-1.0) if key == "progress" else b[key]), key
        assert a["prompts"] == b["prompts"]
        ids = a["completion_ids"]
        replies = (ids >= 300) & (ids < 400)  # ScriptedTurns draws the environment's tokens from 300..399, the model's below
        assert torch.equal(a["env"], replies)
        assert (a["model"] | a["env"]).sum() > 0 and not (a["model"] & a["env"]).any()
        starts = replies[:, 1:] & ~replies[:, :-1]  # one environment reply between consecutive model turns
        assert torch.equal(a["count"], 1 + starts.sum(-1))
        k = torch.arange(a["progress"].shape[1])
        expected = torch.where(k < a["count"].unsqueeze(1), (k + 1) / 3.0, torch.nan)  # turn k's progress (k+1)/3
        torch.testing.assert_close(a["progress"], expected, equal_nan=True)
        assert set(a["count"].tolist()) <= {1, 2, 3} and a["count"].max() > 1
    logged = [h for h in ranks[0]["log_history"] if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logged)
    rounds = [h["trl_credit/generation_rounds"] for h in logged]
    assert rounds == [h["trl_credit/generation_rounds"] for h in ranks[1]["log_history"] if "loss" in h]
    assert max(rounds) > 1, f"constant groups are dropped and refilled across processes: {rounds}"
