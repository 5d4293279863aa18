"""The contract between the host and its plugins: every hook a plugin may implement.

A plugin is a class with a pydantic ``Config`` and methods marked ``@hookimpl`` whose names and
argument names are those below (pluggy checks both when the plugin is registered). A method may take
fewer arguments than the spec lists; it may not take others. Its other members (``check_args``,
``refill``, ``state_dict`` ...) are declared by `trl_credit.Plugin` (`trl_credit.plugin`).

Shapes: ``N`` = completions in the batch (all processes, whole groups), ``G`` = completions per prompt
(``num_generations``), ``N // G`` groups, ``K`` = reward columns, ``T`` = padded completion length.

Order: the host calls the plugins of one hook family in the order the user listed them in
``plugins:``, never in pluggy's registration order. Every hook runs on every process with the same
``RolloutBatch`` (gathered, identical on every rank), so a plugin never needs collective calls of its
own; the host slices out the local rows afterwards.

Per step the host runs, for each generation round:
[``augment_rollouts`` -> extra completions generated and scored] -> ``shape_rewards`` (chained) -> ``filter_rollouts`` (AND) -> [refill rounds] ->
``compute_advantages`` (exactly one) -> ``transform_advantages`` (chained) -> ``kl_coefficient``
(at most one) -> ``on_batch_end``; then, for each micro-batch inside TRL's ``compute_loss``:
``loss_weights`` (multiplied; clip bounds from at most one plugin) -> TRL's loss -> ``loss_terms`` (added).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # heavy imports only for type checkers
    import torch

    from trl_credit.augment import Augmentation
    from trl_credit.batch import PromptStats, RolloutBatch
    from trl_credit.loss import LossInputs, LossWeights

PROJECT = "trl_credit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def augment_rollouts(batch: RolloutBatch) -> list[Augmentation] | None:
    """Ask for more completions of chosen groups, from a changed prompt.  Requests of all plugins are joined.

    :param batch: the round as TRL generated and scored it (rewards not shaped yet, nothing filtered).
    :return: a list of `trl_credit.Augmentation` (``group``, ``prompt``, ``context``, ``replace``) or
        ``None``. For each request the host generates ``G`` completions from ``prompt`` through TRL's
        own generation and scores them with the run's reward functions; the new group joins the
        round (or replaces ``group``), marked in the batch columns ``trl_credit_augmented`` (the
        context) and ``trl_credit_source_prompt`` (the group's own prompt), and every later hook and
        the loss see it like any group. At most as many augmented groups as the round has groups;
        with several processes the requests are cut to a multiple of their number. Logged:
        ``trl_credit/augmented_groups``, ``trl_credit/augmented_tokens``, ``trl_credit/augmented_ratio``.
    Called once per generation round (refill rounds included), on every rank, before ``shape_rewards``.
    """


@hookspec
def shape_rewards(batch: RolloutBatch) -> torch.Tensor | dict[str, Any] | None:
    """Reshape the reward matrix before advantages are computed.  Chained, in config order.

    :param batch: ``batch.rewards`` is the current float32 ``(N, K)`` matrix (NaN = the reward
        function returned ``None``), ``batch.reward_names`` its ``K`` column names and
        ``batch.reward_weights`` the ``(K,)`` weights. Earlier shapers' output is already applied.
    :return: ``None`` (no change); a ``(N, K)`` tensor that replaces the matrix column for column;
        or a mapping ``{column: values}`` where ``values`` is ``(N,)`` or ``(values, weight)``:
        an existing column is replaced (its weight kept unless given), a new one is appended
        (weight 1.0 unless given). A shaper may not introduce NaN where its input had none; a new
        column may be NaN only on rows no reward function scored (every input column NaN), which
        keeps them unscorable (``batch.scorable``).
    Called once per generation round, on every rank, before filtering.
    """


@hookspec
def filter_rollouts(batch: RolloutBatch) -> torch.Tensor | None:
    """Say which completions take part in the update.  Results are AND-combined.

    :param batch: the shaped batch of one generation round.
    :return: a bool keep mask of shape ``(N,)`` (per completion) or ``(N // G,)`` (per group), or
        ``None`` to keep everything. A dropped completion gets advantage 0, is masked out of the
        loss and does not count in its normaliser, so kept completions are not diluted. If every
        completion is dropped the optimiser step is skipped and logged (``trl_credit/skipped_update``).
    Refill: a plugin whose ``refill()`` returns a `trl_credit.Refill` asks the host to draw more
    prompts (at most ``max_rounds`` extra rounds, and no new round once ``max_tokens`` extra tokens
    were generated) until the batch holds as many kept groups as it had groups (DAPO dynamic
    sampling). Called once per generation round, on every rank, after ``shape_rewards``.
    """


@hookspec
def compute_advantages(batch: RolloutBatch) -> torch.Tensor:
    """Compute the advantages of the kept completions.  Exclusive: exactly one estimator runs.

    The built-in ``grpo`` estimator reproduces TRL's own computation (``scale_rewards``,
    ``multi_objective_aggregation``, NaN rows -> 0) and is used when no enabled plugin
    implements this hook; two enabled estimators are a configuration error.

    :param batch: every group with at least one kept completion, whole (groups whose completions
        were all dropped are left out), rewards shaped. ``batch.kept`` is the filters' verdict per
        completion and may be partly False inside a group: a dropped completion still counts in its
        group's baseline (as TRL counts truncated completions) and gets advantage 0 afterwards,
        whatever the estimator returns for it. A completion no reward function scored
        (``batch.scorable`` False: every reward NaN) is out of the built-in estimator's baseline and
        gets 0 from it, as in TRL; a plugin leaves it out of its group statistics and credits it
        nothing, unless its method says otherwise (``gdpo``'s ``nan_policy: zero``).
    :return: float ``(N,)`` sequence advantages or ``(N, T)`` per-token advantages (``T`` =
        ``batch.completion_ids.shape[1]``), finite everywhere.
    Called once per optimiser batch (after refill), on every rank.
    """


@hookspec
def transform_advantages(batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
    """Post-process advantages (token-level credit, clipping, re-weighting).  Chained, in config order.

    :param batch: the same groups the estimator saw (see ``compute_advantages``).
    :param advantages: ``(N,)`` or ``(N, T)`` output of the estimator or of the previous transform.
    :return: ``(N,)`` or ``(N, T)`` finite tensor (a transform may turn ``(N,)`` into ``(N, T)``),
        or ``None`` for no change. Values at padded positions are ignored by the loss, and so are
        the rows of dropped completions (the host sets them to 0 after the last transform).
    Called once per optimiser batch, on every rank, after ``compute_advantages``.
    """


@hookspec
def kl_coefficient(batch: RolloutBatch) -> float | None:
    """Choose the KL coefficient ``beta`` of the loss for this generation batch.  Exclusive: at most one plugin.

    :param batch: the final batch (after filtering and refill; ``batch.kept`` is the verdict).
    :return: ``beta >= 0`` used in place of ``GRPOConfig.beta`` by every optimiser step that trains
        on this batch (``loss += beta * KL(policy || reference)`` per token, TRL's k3 estimator),
        or ``None`` to keep ``GRPOConfig.beta``. Logged as ``trl_credit/beta``.
    The host makes sure reference log-probs exist whenever ``beta > 0``: TRL's when the config's
    beta is non-zero, otherwise the host scores them (PEFT: the base model with adapters disabled).
    A run with neither a reference model nor a PEFT adapter is refused at startup.
    Called once per generation batch, on every rank, after the advantage transforms.
    """


@hookspec
def loss_weights(loss: LossInputs) -> LossWeights | None:
    """Weight tokens and set per-sample clip bounds of TRL's loss for one micro-batch.  Token weights multiplied.

    :param loss: this process's rows of the micro-batch (`trl_credit.LossInputs`): ids, ``mask``,
        ``advantages``, ``old_logps``, ``ref_logps``, ``loss_type``, the config's ``epsilon_low`` /
        ``epsilon_high``, ``beta``, and ``rows`` into ``loss.batch`` (the generation batch). The new
        log-probs are not computed yet (``loss.logps`` is None).
    :return: a `trl_credit.LossWeights` or ``None``. ``token``: ``(B, T)`` finite weights >= 0 that
        multiply TRL's loss mask, as its ``tool_mask`` does (policy term, KL term and entropy bonus of
        the token; and its share of the normaliser under ``grpo``/``sapo``/``bnpo``).
        ``epsilon_low`` / ``epsilon_high``: ``(B,)`` finite bounds >= 0 used in place of the config's
        for those rows, under the loss types with a clipped surrogate (`trl_credit.loss.CLIPPED_LOSSES`);
        at most one plugin may set them in a run.
    Called for every micro-batch, on every process, inside ``compute_loss`` (also when an update is
    repeated with ``num_iterations > 1``).
    """


@hookspec
def loss_terms(loss: LossInputs) -> dict[str, torch.Tensor] | None:
    """Add named terms to the loss of one micro-batch.  Summed over plugins.

    :param loss: as for ``loss_weights``, plus ``loss.logps`` (``(B, T)`` per-token log-probs of the
        policy *with gradient*) and ``loss.entropies``, both from TRL's own forward pass (no extra
        pass). ``loss.aggregate(x)`` reduces a ``(B, T)`` quantity the way the run's ``loss_type``
        reduces its per-token loss, so a term can match TRL's normalisation.
    :return: ``{name: scalar tensor}`` (finite; with gradient where the term should train the
        policy) or ``None``. Each term is added to TRL's loss, divided by the gradient-accumulation
        steps as TRL divides its own, and logged as ``trl_credit/<plugin>/<name>`` (unscaled).
    Called for every micro-batch, on every process, right after TRL's loss.
    """


@hookspec
def prompt_weights(stats: PromptStats, step: int) -> torch.Tensor | None:
    """Give every training prompt a sampling weight (prompt curriculum).  Multiplied together.

    :param stats: host-tracked per-prompt statistics over past rollouts, indexed by dataset row:
        ``stats.seen`` and ``stats.passed`` (float ``(P,)`` counts), ``stats.latest_seen`` and
        ``stats.latest_passed`` (the same over the step each prompt was last scored in),
        ``stats.reward_sum`` and ``stats.pass_rate(latest=False)`` (NaN where never seen), ``stats.last_step``.
    :param step: the optimiser step about to be sampled for.
    :return: non-negative finite ``(P,)`` weights (not necessarily normalised), or ``None``.
        The host multiplies the weights of all curriculum plugins, normalises them and samples
        each generation batch's prompts without replacement, seeded and identical on every rank.
    Called before each generation batch is drawn, on every rank.
    """


@hookspec
def on_train_begin(trainer: Any) -> None:
    """Called once when training starts, on every rank, after the model is wrapped.

    :param trainer: the `CreditGRPOTrainer`. Checks of settings belong in ``check_args``, which
        runs before the model loads.
    """


@hookspec
def on_batch_end(batch: RolloutBatch, advantages: torch.Tensor) -> None:
    """Observe a finished batch; for statistics and schedules.

    :param batch: the final batch (after refill; ``batch.kept`` is the verdict).
    :param advantages: ``(N,)`` or ``(N, T)`` final advantages (0 for dropped completions).
    Called once per optimiser batch, on every rank, after ``kl_coefficient``.
    """


@hookspec
def on_step_end(trainer: Any, step: int, logs: dict[str, float]) -> None:
    """Called after every optimiser step with the global step and the metrics logged so far.

    :param trainer: the `CreditGRPOTrainer`.
    :param step: the global optimiser step just finished.
    :param logs: this logging window's metrics so far (name -> mean).
    Use it for schedules and annealing (change your own config or ``trainer.args`` fields).
    Called on every rank.
    """


#: Every hook a plugin may implement, in pipeline order.
HOOKS = (
    "augment_rollouts",
    "shape_rewards",
    "filter_rollouts",
    "compute_advantages",
    "transform_advantages",
    "kl_coefficient",
    "loss_weights",
    "loss_terms",
    "prompt_weights",
    "on_train_begin",
    "on_batch_end",
    "on_step_end",
)
