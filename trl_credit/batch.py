"""`RolloutBatch`: what every hook sees, and `PromptStats`: what curricula see.

A batch holds whole groups, gathered across processes, identical on every rank. Tensors live on the
CPU or the training device; plugins should create new tensors with ``device=batch.device``. A batch is
read-only for hooks: the pipeline stops a plugin that edits one of its tensors (or a cached score) in
place, because other plugins and TRL's loss read them.

Scorers (`policy_logps`, `policy_entropies`, `ref_logps`, `continuation_logps`, `completion_logps`,
`prefix_logps`, `probe`, `soft_values`) are lazy: nothing
runs until a plugin calls one, a result is cached for the rest of the batch, and what TRL already
computed (old log-probs, reference log-probs) is reused.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from trl_credit.probes import Probes
    from trl_credit.turns import Turns


#: The dataset column the host adds with each prompt's row index (reward functions receive it too).
PROMPT_INDEX = "trl_credit_prompt_index"


class Scorer(Protocol):
    """What a `RolloutBatch` asks its model backend for (the trainer, or a test double)."""

    def token_scores(self, kind: str) -> torch.Tensor:
        """``kind`` in ``policy_logps | policy_entropies | ref_logps``: a no-grad ``(N, T)`` tensor."""

    def continuation_logps(
        self, prefixes: Sequence[str], continuations: Sequence[str], model: str
    ) -> list[torch.Tensor]:
        """Per-token log-probs of each continuation after its prefix (one 1-D tensor each)."""

    def completion_logps(self, rows: Sequence[int], prompts: Sequence[Any], model: str, width: int) -> torch.Tensor:
        """``(len(rows), width)`` log-probs of the batch's own completion tokens after other prompts."""

    def prefix_logps(self, rows: Sequence[int], ends: Sequence[int], continuations: Sequence[str],
                     model: str, contexts: Sequence[str]) -> list[torch.Tensor]:
        """Per-token log-probs of ``continuations[j]`` after row ``rows[j]``'s prompt + first ``ends[j]`` tokens
        + ``contexts[j]`` (not scored)."""

    def soft_values(self, model: str, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q (N, T), V (N, T + 1))``: sampled-token logits and temperature-scaled logsumexp (see `RolloutBatch.soft_values`)."""

    def score_texts(self, rows: Sequence[int], inputs: Sequence[dict], prompts: Sequence[Any],
                    texts: Sequence[str]) -> torch.Tensor:
        """``(M, K)`` the run's reward functions on ``texts`` as completions of ``prompts`` (with ``inputs``' columns)."""

    def probe(self, rows: Sequence[int], ends: Sequence[int], cues: Sequence[str], num_samples: int,
              max_new_tokens: int, temperature: float, top_k: int, model: str) -> list[dict[str, Any]]:
        """Sampled continuations after row ``rows[j]``'s prompt + first ``ends[j]`` tokens + ``cues[j]`` (see
        `RolloutBatch.probe`): per entry a dict of ``tokens``, ``mask``, ``logps`` ``(S, L)``, ``topk_ids``,
        ``topk_logps`` ``(S, L, k)`` and ``texts``."""


@dataclass
class RolloutBatch:
    """One generation round (or the kept part of it), gathered across processes.

    Attributes (``N`` completions, ``G`` per prompt, ``K`` reward columns, ``T`` padded length):

    - ``prompts``, ``completions``: lists of length ``N`` (strings or chat messages, as in TRL).
    - ``completion_ids`` ``(N, T)`` long, right-padded; ``completion_mask`` ``(N, T)`` 0/1 (TRL's mask:
      truncated completions are 0 when ``mask_truncated_completions`` is set).
    - ``rewards`` ``(N, K)`` float32 with NaN where a reward function returned ``None``;
      ``reward_names`` (K), ``reward_weights`` ``(K,)``.
    - ``num_generations`` ``G``; groups are consecutive rows ``[g*G, (g+1)*G)``.
    - ``columns``: the dataset's other columns, one value per completion (``answer`` ...).
    - ``prompt_index`` ``(N,)`` dataset row of each completion's prompt (-1 when unknown).
    - ``step``: the global optimiser step; ``args``: the ``GRPOConfig``; ``tokenizer``.
    - ``kept`` ``(N,)`` bool: the filters' verdict (all True before filtering).
    - ``tool_mask`` ``(N, T)`` 0/1 or None: TRL's mask of multi-turn rollouts (1 on the model's tokens,
      0 on tool or environment replies); `turns` reads it.
    """

    prompts: list
    completions: list
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    reward_names: list[str]
    reward_weights: torch.Tensor
    num_generations: int
    columns: dict[str, list] = field(default_factory=dict)
    prompt_index: torch.Tensor | None = None
    step: int = 0
    args: Any = None
    tokenizer: Any = None
    kept: torch.Tensor | None = None
    tool_mask: torch.Tensor | None = None
    scorer: Scorer | None = None
    token_cache: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    _rows: torch.Tensor | None = None  # rows of the root batch this view selects
    _root: RolloutBatch | None = None

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if self.kept is None:
            self.kept = torch.ones(n, dtype=torch.bool, device=self.rewards.device)
        if self.prompt_index is None:
            self.prompt_index = torch.full((n,), -1, dtype=torch.long, device=self.rewards.device)

    # ----------------------------------------------------------------- structure
    _LAZY = ("completion_ids", "completion_mask")

    def __getattr__(self, name: str):
        # A view made by `select` copies its rows of the (N, T) ids and mask only when first read.
        if name in RolloutBatch._LAZY and "_root" in self.__dict__ and self.__dict__["_root"] is not None:
            value = getattr(self.__dict__["_root"], name)[self.__dict__["_rows"]]
            self.__dict__[name] = value
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def width(self) -> int:
        """``T``: the padded completion length (no copy, also on views)."""
        return self.root.completion_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.rewards.device

    @property
    def num_completions(self) -> int:
        return self.rewards.shape[0]

    @property
    def num_groups(self) -> int:
        return self.num_completions // self.num_generations

    @property
    def group_ids(self) -> torch.Tensor:
        """``(N,)`` long: the group of each completion."""
        return torch.arange(self.num_completions, device=self.device) // self.num_generations

    @property
    def completion_lengths(self) -> torch.Tensor:
        """``(N,)`` long: unmasked tokens per completion (computed once per batch)."""
        if "completion_lengths" not in self.token_cache:
            self.token_cache["completion_lengths"] = self.completion_mask.sum(dim=1).long()
        return self.token_cache["completion_lengths"]

    @property
    def pad_token_id(self) -> int | None:
        return getattr(self.tokenizer, "pad_token_id", None)

    @property
    def max_completion_length(self) -> int:
        """``args.max_completion_length`` when known, else the padded width ``T``."""
        value = getattr(self.args, "max_completion_length", None)
        return int(value) if value is not None else self.width

    def turns(self) -> Turns:
        """The turns of each completion (`trl_credit.Turns`): the model's token spans, the tools' or
        environment's replies between them, counts, lengths and tool calls / failures per turn;
        `Turns.broadcast` spreads per-turn values over the tokens of their turn. Single-turn batches
        have one turn per completion."""
        from trl_credit.turns import turns_of

        if "turns" not in self.token_cache:
            completions = self.completions if isinstance(self.completions, list) and len(self.completions) == \
                self.num_completions else None
            self.token_cache["turns"] = turns_of(self.completion_mask, self.tool_mask, completions)
        return self.token_cache["turns"]

    def turn_values(self, name: str) -> torch.Tensor:
        """``(N, K)`` float32 per-turn values the environment recorded under ``name``, NaN where it recorded none.

        Read from the column ``name``: one list per completion whose k-th entry (a number or None) belongs to
        the model's k-th turn. A ``rollout_func`` returns such a column as an extra field; an
        ``environment_factory`` environment keeps ``self.turn_values = {name: [...]}`` (the host copies it
        after each rollout). ``K`` is `Turns.max_turns`; a list longer than its completion's turns is an error,
        except on a row with no model turn left (``mask_truncated_completions`` masks a truncated row whole),
        which reads NaN.
        """
        turns = self.turns()
        values = self.column(name)
        out = torch.full((self.num_completions, turns.max_turns), math.nan, dtype=torch.float32)
        counts = turns.count.tolist()
        for i, row in enumerate(values):  # a loop over rows, bounded by the batch
            if row is None or counts[i] == 0:  # no model turn left: TRL masks a truncated row whole
                continue
            if not isinstance(row, (list, tuple)):
                raise ValueError(f"turn_values({name!r}): row {i} holds {type(row).__name__}, expected a list with "
                                 "one value (or None) per model turn")
            if len(row) > counts[i]:
                raise ValueError(f"turn_values({name!r}): row {i} has {len(row)} values for {counts[i]} model "
                                 "turn(s); record one value per turn")
            if row:
                out[i, :len(row)] = torch.tensor([math.nan if v is None else float(v) for v in row])
        return out.to(self.device)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """View a per-completion tensor ``(N, ...)`` as ``(N // G, G, ...)``."""
        return x.reshape(self.num_groups, self.num_generations, *x.shape[1:])

    # ----------------------------------------------------------------- rewards
    def reward(self, name: str) -> torch.Tensor:
        """The ``(N,)`` column ``name`` (KeyError lists the available ones)."""
        try:
            return self.rewards[:, self.reward_names.index(name)]
        except ValueError:
            raise KeyError(f"no reward column {name!r}; columns are {self.reward_names}") from None

    def total_reward(self) -> torch.Tensor:
        """``(N,)`` weighted sum of the columns, NaN where every column is NaN (as TRL)."""
        total = (self.rewards * self.reward_weights.to(self.rewards).unsqueeze(0)).nansum(dim=1)
        return total.masked_fill(torch.isnan(self.rewards).all(dim=1), math.nan)

    @property
    def scorable(self) -> torch.Tensor:
        """``(N,)`` bool: some reward function scored the completion (not every column NaN). An unscorable
        completion takes no part in GRPO's baseline and gets advantage 0 from it (as TRL)."""
        return ~torch.isnan(self.rewards).all(dim=1)

    def column(self, name: str) -> list:
        """A dataset column, one value per completion (KeyError lists the available ones)."""
        try:
            return self.columns[name]
        except KeyError:
            raise KeyError(f"no dataset column {name!r}; columns are {sorted(self.columns)}") from None

    # ----------------------------------------------------------------- metrics
    def log_metric(self, name: str, value: float, *, plugin: Any) -> None:
        """Log a scalar under ``trl_credit/<plugin>/<name>`` (averaged over the logging window).

        ``plugin``: the plugin instance (or its key as a string); ``Plugin.log_metric(batch, name,
        value)`` passes itself. The key is the one the host registered it under (``name#2`` for a
        second copy).
        """
        owner = plugin if isinstance(plugin, str) else getattr(plugin, "trl_credit_key", None)
        if owner is None:
            raise ValueError(f"log_metric: {type(plugin).__name__} is not an enabled plugin (no key)")
        self.root.metrics[f"{owner}/{name}"].append(float(value))

    # ----------------------------------------------------------------- scorers
    @property
    def root(self) -> RolloutBatch:
        return self._root if self._root is not None else self

    def _token_scores(self, kind: str) -> torch.Tensor:
        root = self.root
        if kind not in root.token_cache:
            if root.scorer is None:
                raise RuntimeError(
                    f"{kind} were asked for but this batch has no model to score with; in tests pass "
                    f"`{ {'policy_logps': 'logps', 'policy_entropies': 'entropies'}.get(kind, kind)}=` to "
                    "trl_credit.testing.make_batch"
                )
            root.token_cache[kind] = root.scorer.token_scores(kind)
        if self._rows is None:
            return root.token_cache[kind]
        if kind not in self.token_cache:  # a view caches its own rows once
            self.token_cache[kind] = root.token_cache[kind][self._rows]
        return self.token_cache[kind]

    def policy_logps(self) -> torch.Tensor:
        """``(N, T)`` no-grad per-token log-probs of the completions under the current policy."""
        return self._token_scores("policy_logps")

    def policy_entropies(self) -> torch.Tensor:
        """``(N, T)`` no-grad per-token entropies (nats, full distribution) under the current policy."""
        return self._token_scores("policy_entropies")

    def ref_logps(self) -> torch.Tensor:
        """``(N, T)`` no-grad per-token log-probs under the reference model (PEFT: adapters disabled)."""
        return self._token_scores("ref_logps")

    def mean_policy_logps(self) -> torch.Tensor:
        """``(N,)`` token-mean policy log-prob per completion (0 for empty completions), cached."""
        if "mean_policy_logps" not in self.token_cache:
            logps = self.policy_logps()
            mask = self.completion_mask.to(logps.dtype)
            total = torch.bmm(logps.unsqueeze(1), mask.unsqueeze(2)).reshape(-1)  # masked row sums in one kernel
            self.token_cache["mean_policy_logps"] = total / self.completion_lengths.clamp(min=1).to(logps.dtype)
        return self.token_cache["mean_policy_logps"]

    def continuation_logps(
        self,
        prefixes: Sequence[str],
        continuations: Sequence[str],
        model: Any = "policy",
        reduce: str = "sum",
    ) -> torch.Tensor | list[torch.Tensor]:
        """Teacher-forced log-probs of ``continuations[i]`` after ``prefixes[i]`` (batched, no-grad, cached).

        :param prefixes: texts fed as context (already chat-formatted if you want that).
        :param continuations: texts whose tokens are scored.
        :param model: ``"policy"``, ``"reference"`` or one of the plugin's adapters (``self.adapter(name)``).
        :param reduce: ``"sum"`` or ``"mean"`` gives an ``(M,)`` tensor; ``"none"`` a list of 1-D tensors.
        """
        if len(prefixes) != len(continuations):
            raise ValueError("prefixes and continuations must have the same length")
        model = _model_kind(model)
        root = self.root
        cache = root.token_cache.setdefault("continuations", {})  # type: ignore[arg-type]
        missing = [(p, c) for p, c in zip(prefixes, continuations) if (model, p, c) not in cache]
        if missing:
            if root.scorer is None:
                raise RuntimeError("continuation scoring needs a model; in tests pass `continuation_fn=` to "
                                   "trl_credit.testing.make_batch")
            unique = list(dict.fromkeys(missing))
            scores = root.scorer.continuation_logps([p for p, _ in unique], [c for _, c in unique], model)
            cache.update({(model, p, c): s for (p, c), s in zip(unique, scores)})
        per_token = [cache[(model, p, c)] for p, c in zip(prefixes, continuations)]
        if reduce == "none":
            return per_token
        sums = torch.stack([t.sum() for t in per_token]) if per_token else torch.zeros(0)
        if reduce == "sum":
            return sums
        if reduce == "mean":
            lengths = torch.tensor([max(len(t), 1) for t in per_token], dtype=sums.dtype)
            return sums / lengths
        raise ValueError("reduce must be 'sum', 'mean' or 'none'")

    def completion_logps(self, prompts: Sequence[Any], model: Any = "policy") -> torch.Tensor:
        """``(N, T)`` no-grad log-probs of the batch's *own* completion tokens after other prompts (cached).

        The re-scoring pass of on-policy distillation and of off-context corrections: the sampled
        tokens, unchanged (no re-tokenisation), scored under ``prompts[i]`` instead of the prompt they
        were sampled from (a privileged or skill-augmented context, a hint removed or added). Prompts
        are strings or chat message lists, rendered and tokenised by TRL's own prompt tokenisation.
        Values at padded positions are 0. Costs one no-grad forward pass over the rows not cached.

        :param prompts: ``N`` prompts, one per completion of this batch (or view).
        :param model: ``"policy"``, ``"reference"`` (PEFT: adapters disabled) or one of the plugin's
            adapters (``self.adapter(name)``).
        """
        if len(prompts) != self.num_completions:
            raise ValueError(f"completion_logps: {len(prompts)} prompts for {self.num_completions} completions")
        model = _model_kind(model)
        root = self.root
        rows = list(range(self.num_completions)) if self._rows is None else self._rows.tolist()
        cache = root.token_cache.setdefault("completion_logps", {})  # type: ignore[arg-type]
        keys = [(model, row, repr(prompt)) for row, prompt in zip(rows, prompts)]
        prompt_of = dict(zip(keys, prompts))
        todo = [key for key in dict.fromkeys(keys) if key not in cache]
        if todo:
            if root.scorer is None:
                raise RuntimeError("completion scoring needs a model; in tests pass `completion_logps_fn=` to "
                                   "trl_credit.testing.make_batch")
            scores = root.scorer.completion_logps([row for _, row, _ in todo], [prompt_of[key] for key in todo],
                                                  model, root.width)
            cache.update(zip(todo, scores))
        return torch.stack([cache[key] for key in keys]).to(self.device) if keys else torch.zeros(0, self.width)

    def prefix_logps(self, ends: torch.Tensor, continuations: Sequence[str], model: Any = "policy",
                     reduce: str = "mean", context: str | Sequence[str] | None = None) -> torch.Tensor:
        """Teacher-forced log-probs of ``continuations[i]`` after row ``i``'s prompt and its first ``ends[i, k]``
        completion tokens, for every ``k`` (no-grad, batched over the whole batch, cached).

        The step-boundary scorer of IGPO, TRACE and P2S: a gold answer (or gold chain of thought, or a
        probe cue) scored after each step prefix of every completion; `trl_credit.step_ends` gives the
        boundaries, and ``ends[i, k] = 0`` scores it after the prompt alone. The completion tokens are the
        sampled ids (never re-tokenised); the continuation is tokenised without special tokens. One
        sequence per valid ``(i, k)``, in micro-batches of ``per_device_train_batch_size``.

        :param ends: ``(N, K)`` long, completion-token prefix lengths; entries < 0 are skipped.
        :param continuations: ``N`` texts, one per completion (the same after each of its prefixes).
        :param model: ``"policy"``, ``"reference"`` or one of the plugin's adapters (``self.adapter(name)``).
        :param reduce: ``"sum"`` or ``"mean"`` over the continuation's tokens gives ``(N, K)``; ``"none"``
            gives ``(N, K, C)`` per-token log-probs (``C`` the longest continuation, 0-padded at the end).
            Skipped entries are NaN (``"none"``: 0).
        :param context: text teacher-forced between the prefix and the continuation but not scored (a cue such
            as IGPO's "Now there's enough information to answer"), one for all rows or one per row; it is
            tokenised on its own, so the continuation's tokens are exactly those of its own text.
        """
        import torch

        model = _model_kind(model)
        ends = torch.as_tensor(ends, dtype=torch.long).cpu()
        if ends.dim() != 2 or ends.shape[0] != self.num_completions:
            raise ValueError(f"prefix_logps: ends must be (N={self.num_completions}, K), got {tuple(ends.shape)}")
        if len(continuations) != self.num_completions:
            raise ValueError(f"prefix_logps: {len(continuations)} continuations for {self.num_completions} completions")
        if ends.numel() and int(ends.max()) > self.width:
            raise ValueError(f"prefix_logps: an end ({int(ends.max())}) is past the completion width {self.width}")
        if reduce not in ("sum", "mean", "none"):
            raise ValueError("reduce must be 'sum', 'mean' or 'none'")
        contexts = [context or ""] * self.num_completions if context is None or isinstance(context, str) \
            else list(context)
        if len(contexts) != self.num_completions:
            raise ValueError(f"prefix_logps: {len(contexts)} contexts for {self.num_completions} completions")
        root = self.root
        rows = list(range(self.num_completions)) if self._rows is None else self._rows.tolist()
        cache = root.token_cache.setdefault("prefix_logps", {})  # type: ignore[arg-type]
        wanted = [(model, row, int(e), text, ctx) for i, (row, text, ctx) in enumerate(zip(rows, continuations, contexts))
                  for e in ends[i].tolist() if e >= 0]
        todo = list(dict.fromkeys(key for key in wanted if key not in cache))
        if todo:
            if root.scorer is None or not hasattr(root.scorer, "prefix_logps"):
                raise RuntimeError("prefix scoring needs a model; in tests pass `prefix_logps_fn=` to "
                                   "trl_credit.testing.make_batch")
            scores = root.scorer.prefix_logps([k[1] for k in todo], [k[2] for k in todo], [k[3] for k in todo], model,
                                              [k[4] for k in todo])
            cache.update(zip(todo, scores))
        width = max((len(cache[key]) for key in wanted), default=0)
        n, k = ends.shape
        out = torch.zeros(n, k, width) if reduce == "none" else torch.full((n, k), math.nan)
        for i, (row, text, ctx) in enumerate(zip(rows, continuations, contexts)):  # cached results: no model work
            for j, e in enumerate(ends[i].tolist()):
                if e < 0:
                    continue
                values = cache[(model, row, int(e), text, ctx)]
                if reduce == "none":
                    out[i, j, : len(values)] = values
                else:
                    out[i, j] = values.sum() / (max(len(values), 1) if reduce == "mean" else 1)
        return out.to(self.device)

    def probe(self, ends: torch.Tensor, cue: str | Sequence[str], num_samples: int = 5, max_new_tokens: int = 10,
              temperature: float = 1.0, top_k: int = 20, model: Any = "policy") -> Probes:
        """Sample ``num_samples`` short continuations after row ``i``'s prompt, its first ``ends[i, k]`` completion
        tokens and ``cue``, for every ``k`` (`trl_credit.Probes`: ids, log-probs, top-``k`` alternatives, texts).

        Answer probes after each step (SPAE), a forced answer at a budget (MRT). No-grad Hugging Face
        generation on the training model, under its own random stream (TRL's sampling is unaffected),
        batched, cached per arguments; cost logged as ``trl_credit/cost/probe_seconds`` and ``probe_tokens``.

        :param ends: ``(N, K)`` long prefix lengths in completion tokens; entries < 0 are not probed.
        :param cue: text appended after each prefix (one for all rows, or one per row).
        :param model: ``"policy"``, ``"reference"`` or one of the plugin's adapters (``self.adapter(name)``).
        """
        import torch

        from trl_credit.probes import Probes

        model = _model_kind(model)
        ends = torch.as_tensor(ends, dtype=torch.long).cpu()
        n = self.num_completions
        if ends.dim() != 2 or ends.shape[0] != n:
            raise ValueError(f"probe: ends must be (N={n}, K), got {tuple(ends.shape)}")
        if ends.numel() and int(ends.max()) > self.width:
            raise ValueError(f"probe: an end ({int(ends.max())}) is past the completion width {self.width}")
        cues = [cue] * n if isinstance(cue, str) else list(cue)
        if len(cues) != n:
            raise ValueError(f"probe: {len(cues)} cues for {n} completions")
        if num_samples < 1 or max_new_tokens < 1 or top_k < 1:
            raise ValueError("probe: num_samples, max_new_tokens and top_k must be >= 1")
        root = self.root
        rows = list(range(n)) if self._rows is None else self._rows.tolist()
        settings = (model, num_samples, max_new_tokens, float(temperature), top_k)
        cache = root.token_cache.setdefault("probes", {})  # type: ignore[arg-type]
        wanted = [(settings, row, int(e), text) for i, (row, text) in enumerate(zip(rows, cues))
                  for e in ends[i].tolist() if e >= 0]
        todo = list(dict.fromkeys(key for key in wanted if key not in cache))
        if todo:
            if root.scorer is None or not hasattr(root.scorer, "probe"):
                raise RuntimeError("probes need a model; in tests pass `probe_fn=` to trl_credit.testing.make_batch")
            samples = root.scorer.probe([k[1] for k in todo], [k[2] for k in todo], [k[3] for k in todo],
                                        num_samples, max_new_tokens, float(temperature), top_k, model)
            cache.update(zip(todo, samples))
        k = ends.shape[1]
        shape = (n, k, num_samples, max_new_tokens)
        out = {"tokens": torch.full(shape, self.pad_token_id or 0, dtype=torch.long),
               "mask": torch.zeros(shape, dtype=torch.long), "logps": torch.zeros(shape),
               "topk_ids": torch.full((*shape, top_k), -1, dtype=torch.long), "topk_logps": torch.full(
                   (*shape, top_k), -math.inf)}
        texts: list = [[None] * k for _ in range(n)]
        valid = ends >= 0
        for i, (row, text) in enumerate(zip(rows, cues)):  # gathers cached samples: no model work here
            for j, e in enumerate(ends[i].tolist()):
                if e >= 0:
                    sample = cache[(settings, row, int(e), text)]
                    for name in out:
                        out[name][i, j] = sample[name]
                    texts[i][j] = list(sample["texts"])
        device = self.device
        return Probes(valid=valid.to(device), texts=texts, **{name: t.to(device) for name, t in out.items()})

    def soft_values(self, model: Any = "reference", temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's logits read as soft Q-values: ``(Q, V)`` with ``Q`` ``(N, T)`` the logit of each sampled
        completion token and ``V`` ``(N, T + 1)`` ``temperature * logsumexp(logits / temperature)`` of the state
        before each completion token, and after the last one (column ``L_i`` of row ``i``); no-grad, cached.

        ``Q_t - V_t`` is ``temperature`` times the token's log-prob at that temperature. The inverse soft Bellman reward of the
        endogenous-reward view (``r_t = Q_t - V_{t+1}``) needs both. TRL's own passes keep only log-probs and
        entropies, so this is a forward pass of its own (logits of the completion positions only, chunked
        to bound the ``(B, T + 1, vocab)`` logits), logged as ``trl_credit/cost/soft_values_seconds``.

        :param model: ``"reference"`` (PEFT: adapters off; or TRL's reference model), ``"policy"`` or an adapter.
        """
        model = _model_kind(model)
        root = self.root
        key = ("soft_values", model, float(temperature))
        if key not in root.token_cache:
            if root.scorer is None or not hasattr(root.scorer, "soft_values"):
                raise RuntimeError("soft values need a model; in tests pass `soft_values=(Q, V)` to "
                                   "trl_credit.testing.make_batch")
            root.token_cache[key] = root.scorer.soft_values(model, float(temperature))  # type: ignore[index]
        q, v = root.token_cache[key]  # type: ignore[misc]
        if self._rows is not None:
            q, v = q[self._rows], v[self._rows]
        return q.to(self.device), v.to(self.device)

    def prefix_prompt(self, row: int, end: int, cue: str = "") -> str:
        """A string prompt that continues row ``row``'s completion: its prompt rendered as TRL renders it (chat
        template with the generation prompt), the first ``end`` completion tokens decoded, then ``cue``.

        For `trl_credit.Augmentation` ``prompts`` (generation from a prefix plus a cue through TRL's own
        path: S-GRPO's exits, MRT's forced answers as training rows). TRL tokenises a string prompt as it is,
        so the new completion continues exactly this text.
        """
        prompt = self.prompts[row]
        if not isinstance(prompt, str):
            prompt = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = self.completion_ids[row, : max(int(end), 0)].tolist()
        return prompt + self.tokenizer.decode(ids, skip_special_tokens=True) + cue

    def score_texts(self, rows: Sequence[int] | torch.Tensor, texts: Sequence[str]) -> torch.Tensor:
        """``(M, K)`` the run's own reward functions on new completion texts for rows ``rows`` of this batch.

        The texts are scored as completions of row ``rows[j]``'s prompt, with its dataset columns, through
        TRL's ``_calculate_rewards`` (conversational prompts get ``[{"role": "assistant", "content": text}]``),
        so a probe's forced answer (MRT) is judged exactly as a rollout. NaN where a function returned None.
        Collective: every rank must call it with the same arguments. Refused in an ``environment_factory`` run:
        TRL passes the rollouts' environments to every reward function, and their state is not the texts'.
        """
        import torch

        rows = [int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
        if len(rows) != len(texts):
            raise ValueError(f"score_texts: {len(rows)} rows for {len(texts)} texts")
        if not rows:
            return torch.zeros(0, len(self.reward_names), device=self.device)
        root = self.root
        if root.scorer is None or not hasattr(root.scorer, "score_texts"):
            raise RuntimeError("score_texts needs the run's reward functions; in tests pass `score_fn=` to "
                               "trl_credit.testing.make_batch")
        base = [row if self._rows is None else int(self._rows[row]) for row in rows]
        prompts = [self.prompts[r] for r in rows]
        inputs = [{"prompt": self.prompts[r], **{k: v[r] for k, v in self.columns.items()},
                   PROMPT_INDEX: int(self.prompt_index[r])} for r in rows]  # the columns TRL's rows had
        return root.scorer.score_texts(base, inputs, prompts, list(texts)).to(self.device)

    # ----------------------------------------------------------------- views
    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """A view of the given rows (whole groups, in order); shares the scorer cache."""
        rows = rows.to(self.device)
        cpu_rows = rows.tolist()
        base_rows = rows if self._rows is None else self._rows[rows]
        view = RolloutBatch(
            prompts=[self.prompts[i] for i in cpu_rows],
            completions=[self.completions[i] for i in cpu_rows],
            completion_ids=None,  # lazy: see __getattr__
            completion_mask=None,
            rewards=self.rewards[rows],
            reward_names=list(self.reward_names),
            reward_weights=self.reward_weights,
            num_generations=self.num_generations,
            columns={k: [v[i] for i in cpu_rows] for k, v in self.columns.items()},
            prompt_index=self.prompt_index[rows],
            step=self.step,
            args=self.args,
            tokenizer=self.tokenizer,
            kept=self.kept[rows],
            tool_mask=self.tool_mask[rows] if self.tool_mask is not None else None,
        )
        view._rows = base_rows
        view._root = self.root
        for name in RolloutBatch._LAZY:
            del view.__dict__[name]
        return view


    @classmethod
    def concat(cls, parts: Sequence[RolloutBatch], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
               scorer: Scorer | None = None) -> RolloutBatch:
        """One batch of the rows of ``parts`` (whole groups, in order), e.g. refill's kept groups.

        ``completion_ids``/``completion_mask`` are the combined ``(N, T)`` tensors (the parts may have
        different widths); token scores every part has cached are carried over, padded to ``T``.
        """
        first = parts[0]
        width = completion_ids.shape[1]
        combined = cls(
            prompts=[p for part in parts for p in part.prompts],
            completions=[c for part in parts for c in part.completions],
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            rewards=torch.cat([part.rewards for part in parts]),
            reward_names=list(first.reward_names),
            reward_weights=first.reward_weights,
            num_generations=first.num_generations,
            columns={k: [v for part in parts for v in part.columns.get(k, [None] * len(part.prompts))]
                     for k in dict.fromkeys(k for part in parts for k in part.columns)},
            prompt_index=torch.cat([part.prompt_index for part in parts]),
            step=first.step,
            args=first.args,
            tokenizer=first.tokenizer,
            kept=torch.cat([part.kept for part in parts]),
            tool_mask=_joined_tool_masks(parts, width, completion_ids.device),
            scorer=scorer,
        )
        for kind in ("policy_logps", "policy_entropies", "ref_logps"):
            if all(kind in part.root.token_cache for part in parts):
                scores = [part._token_scores(kind) for part in parts]
                combined.token_cache[kind] = torch.cat(
                    [torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in scores])
        return combined


def _model_kind(model: Any) -> str:
    """``model=`` of the scorers: ``"policy"``, ``"reference"``, or an `AdapterHandle` (its kind string)."""
    kind = getattr(model, "kind", model)
    if kind in ("policy", "reference") or (isinstance(kind, str) and kind.startswith("adapter:")):
        return kind
    raise ValueError(f"model must be 'policy', 'reference' or a plugin's adapter (self.adapter(name)), got {model!r}")


def _joined_tool_masks(parts: Sequence[RolloutBatch], width: int, device: torch.device) -> torch.Tensor | None:
    """The parts' tool masks padded to ``width`` (1: padding is not a reply), ones for parts without one."""
    if all(part.tool_mask is None for part in parts):
        return None
    masks = []
    for part in parts:
        mask = part.tool_mask if part.tool_mask is not None else torch.ones(part.num_completions, width,
                                                                             dtype=torch.long, device=device)
        masks.append(torch.nn.functional.pad(mask.to(device), (0, width - mask.shape[1]), value=1))
    return torch.cat(masks)


@dataclass
class PromptStats:
    """Host-tracked statistics per training prompt (dataset row), updated from every scored batch.

    A completion *passes* when its total reward is ``>= pass_threshold`` (host default 0.5).
    ``seen``/``passed`` count every rollout since the start; ``latest_seen``/``latest_passed`` count
    only those of the step a prompt was last scored in (``last_step``; refill rounds of one step add
    up), which is what the current policy does on it: a prompt the policy has since learned shows as
    all-pass there while its whole history still looks mixed. ``prompts_per_batch`` is how many
    distinct prompts the host draws for one generation batch (0 when unknown); a curriculum that gives
    exactly that many prompts a positive weight selects them.
    """

    seen: torch.Tensor
    passed: torch.Tensor
    reward_sum: torch.Tensor
    last_step: torch.Tensor
    pass_threshold: float = 0.5
    prompts_per_batch: int = 0
    latest_seen: torch.Tensor | None = None    # None: the whole history (all that is known)
    latest_passed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.latest_seen is None or self.latest_passed is None:
            self.latest_seen, self.latest_passed = self.seen.clone(), self.passed.clone()

    @classmethod
    def empty(cls, num_prompts: int, pass_threshold: float = 0.5) -> PromptStats:
        zeros = torch.zeros(num_prompts, dtype=torch.float64)
        return cls(zeros.clone(), zeros.clone(), zeros.clone(), torch.full((num_prompts,), -1), pass_threshold)

    @property
    def num_prompts(self) -> int:
        return self.seen.shape[0]

    def counts(self, latest: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seen, passed)``, each ``(P,)``: every rollout since the start, or (``latest``) those of the
        step each prompt was last scored in. The tensors themselves, not copies."""
        return (self.latest_seen, self.latest_passed) if latest else (self.seen, self.passed)

    def pass_rate(self, latest: bool = False) -> torch.Tensor:
        """``(P,)`` empirical pass rate (``latest``: in the step each prompt was last scored), NaN for
        prompts never seen."""
        seen, passed = self.counts(latest)
        return passed / seen.where(seen > 0, torch.tensor(math.nan, dtype=seen.dtype))

    def posterior_mean(self, alpha: float = 1.0, beta: float = 1.0, latest: bool = False) -> torch.Tensor:
        """``(P,)`` mean of the Beta(alpha + passed, beta + seen - passed) posterior of each prompt's
        pass rate (a Beta(alpha, beta) prior; unseen prompts get the prior mean; ``latest``: the counts
        of the step each prompt was last scored in)."""
        seen, passed = self.counts(latest)
        return (passed + alpha) / (seen + alpha + beta)

    def mean_reward(self) -> torch.Tensor:
        return self.reward_sum / self.seen.where(self.seen > 0, torch.tensor(math.nan, dtype=self.seen.dtype))

    def update(self, prompt_index: torch.Tensor, total_reward: torch.Tensor, step: int) -> None:
        """Add one batch: ``prompt_index`` ``(N,)`` rows (-1 ignored), ``total_reward`` ``(N,)`` (NaN ignored)."""
        idx = prompt_index.cpu().long()
        reward = total_reward.detach().cpu().to(torch.float64)
        ok = (idx >= 0) & ~torch.isnan(reward)
        idx, reward = idx[ok], reward[ok]
        ones, passes = torch.ones_like(reward), (reward >= self.pass_threshold).to(torch.float64)
        self.seen.index_add_(0, idx, ones)
        self.passed.index_add_(0, idx, passes)
        self.reward_sum.index_add_(0, idx, reward)
        stale = idx[self.last_step[idx] != step]                       # last scored in an earlier step
        self.latest_seen[stale] = 0.0
        self.latest_passed[stale] = 0.0
        self.latest_seen.index_add_(0, idx, ones)
        self.latest_passed.index_add_(0, idx, passes)
        self.last_step[idx] = step

    def state_dict(self) -> dict[str, Any]:
        return {
            "seen": self.seen,
            "passed": self.passed,
            "reward_sum": self.reward_sum,
            "last_step": self.last_step,
            "latest_seen": self.latest_seen,
            "latest_passed": self.latest_passed,
            "pass_threshold": self.pass_threshold,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seen", "passed", "reward_sum", "last_step"):
            getattr(self, key).copy_(state[key])
        # a checkpoint from before 0.2.3 has no latest counts: the whole history stands in for them
        self.latest_seen.copy_(state.get("latest_seen", state["seen"]))
        self.latest_passed.copy_(state.get("latest_passed", state["passed"]))
        self.pass_threshold = state["pass_threshold"]
