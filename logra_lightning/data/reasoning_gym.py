"""Prompts from any reasoning-gym dataset, put through the policy's chat template.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (Apache-2.0) is the environment library
people use for RL on small models: ``gsm_symbolic``, ``countdown``, ``basic_arithmetic``, ``chain_sum``,
``leg_counting`` and ~100 more, each a procedural generator with its own verifier. :class:`ReasoningGymSource`
takes one by name and its config (the dataset's config dataclass fields, e.g. ``{max_terms: 2}``); the reward
is :class:`~logra_lightning.rewards.ReasoningGymReward`, which calls the dataset's ``score_answer``.

Records are ``{"prompt", "answer", "question"}``:

* ``prompt``: ``template`` with ``{question}`` replaced (and ``system`` as the system message), through the
  tokenizer's chat template when the policy's tokenizer has one (:func:`~logra_lightning.data.template.render_prompt`;
  the data module hands the tokenizer over at set-up), then ``assistant_prefix``: the start of the reply, which
  the model continues (``"The answer is"`` makes a small model state its answer first; the completion is what
  follows it, and the reward reads the answer from the completion);
* ``answer``: the entry's address (dataset, config, seed, size, index) and reference answer, as JSON
  (:func:`~logra_lightning.rewards.reasoning_gym.encode_reference`): the reward rebuilds the entry from it;
* ``question``: the dataset's question text.

**Splits.** Items are drawn from the dataset with seed ``seed`` until ``test_size + train_size`` distinct
questions are found (a repeated question is skipped); those are shuffled (``random.Random(seed)``) and the first
``test_size`` are the held-out split, the rest the training split. So the two never share a problem, and both
are samples of the same distribution also when the problem space is small (taking the held-out items first
and the training items from what is left would leave the training split with the rarer problems: on ``gcd``
up to 30 that made 61% of training answers ``1`` against 23% held out). A space too small for the two sizes
is an error that says so. Train and test sources must share ``seed``, ``train_size``, ``test_size``, dataset
and config.

Example::

    >>> args = dict(config={"max_terms": 2, "max_digits": 1}, test_size=4, train_size=50)
    >>> test, train = ReasoningGymSource("chain_sum", "test", **args), ReasoningGymSource("chain_sum", "train", **args)
    >>> test.load()[0]["prompt"]
    'State the final answer to the following arithmetic problem: 1 + 6 ='
    >>> len(train.load()), {r["question"] for r in test.load()} & {r["question"] for r in train.load()}
    (50, set())
    >>> ReasoningGymSource("chain_sums")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    logra_lightning.errors.ConfigError: ReasoningGymSource.dataset='chain_sums': not a reasoning-gym dataset; ...
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from logra_lightning.data.source import PromptSource
from logra_lightning.data.splits import SPLITS
from logra_lightning.data.template import check_template, render_prompt
from logra_lightning.errors import ConfigError
from logra_lightning.rewards.reasoning_gym import check_dataset, encode_reference, make_dataset

OVERDRAW = 10  # draw up to this many times test_size + train_size items to find that many distinct questions


class ReasoningGymSource(PromptSource):
    """Prompts from a reasoning-gym dataset (a ``class_path`` target in configs).

    Args:
        dataset: a reasoning-gym dataset name (``basic_arithmetic``, ``leg_counting``, ...).
        split: ``"train"`` or ``"test"``.
        config: the dataset's config fields (its config dataclass, without ``seed``/``size``).
        train_size: training problems.
        test_size: held-out problems.
        seed: seed of the draw and of the split (train and test sources must share it, and the sizes).
        template: user-message template with a ``{question}`` placeholder.
        system: optional system prompt (e.g. one that asks for ``<answer>`` tags).
        use_chat_template: use the tokenizer's chat template when it has one.
        assistant_prefix: text appended to the rendered prompt, after the chat template's assistant header:
            the reply starts with it and the model's completion continues it (module doc).

    Raises:
        ConfigError: an unknown dataset (the message lists the valid names), an unknown config key (lists the
            dataset's keys), a config reasoning-gym rejects, a bad split or size, reasoning-gym not installed,
            or (at ``load``) fewer distinct training problems than ``train_size``.

    Example::

        >>> source = ReasoningGymSource("leg_counting", config={"max_animals": 2}, train_size=200)  # doctest: +SKIP
        >>> reward = ReasoningGymReward(extract="first_line")  # doctest: +SKIP
        >>> module = PolicyGradientModule("builtin:smollm2-135m-instruct", reward=reward)  # doctest: +SKIP
        >>> Trainer(max_steps=20).fit(module, datamodule=PromptDataModule(source))  # doctest: +SKIP
    """

    def __init__(
        self,
        dataset: str,
        split: str = "train",
        config: dict[str, Any] | None = None,
        train_size: int = 2000,
        test_size: int = 128,
        seed: int = 0,
        template: str = "{question}",
        system: str | None = None,
        use_chat_template: bool = True,
        assistant_prefix: str = "",
    ) -> None:
        name = type(self).__name__
        if split not in SPLITS:
            raise ConfigError(f"{name}.split={split!r}: allowed values are {SPLITS}")
        for key, value in (("train_size", train_size), ("test_size", test_size)):
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{name}.{key}={value!r}: must be an integer >= 1")
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError(f"{name}.config={config!r}: must be a mapping of the dataset's config fields")
        check_template(template)
        check_dataset(dataset, config, what=f"{name}.dataset")
        make_dataset(dataset, config, seed, 1)  # the config's own checks, at start-up
        self.dataset, self.split, self.config = dataset, split, dict(config or {})
        self.train_size, self.test_size, self.seed = train_size, test_size, seed
        if not isinstance(assistant_prefix, str):
            raise ConfigError(f"{name}.assistant_prefix={assistant_prefix!r}: must be a string")
        self.template, self.system, self.use_chat_template = template, system, use_chat_template
        self.assistant_prefix = assistant_prefix
        self.tokenizer = None  # set by the data module before load(), to use the policy's chat template

    def entries(self) -> list[tuple[int, int, int, dict]]:
        """``(seed, size, index, entry)`` of this split's problems, in order (module doc, "Splits")."""
        want = self.test_size + self.train_size
        size = OVERDRAW * want
        ds = make_dataset(self.dataset, self.config, self.seed, size)
        pool, seen = [], set()
        for i in range(size):  # items are generated lazily: a large space stops after about `want` of them
            e = ds[i]
            if e["question"] not in seen:
                seen.add(e["question"])
                pool.append((self.seed, size, i, e))
                if len(pool) == want:
                    break
        else:
            raise ConfigError(
                f"{type(self).__name__}({self.dataset}): only {len(pool)} distinct problems among {size} drawn, "
                f"fewer than test_size + train_size = {want}; lower train_size or test_size, or widen the config"
            )
        random.Random(self.seed).shuffle(pool)
        return pool[: self.test_size] if self.split == "test" else pool[self.test_size :]

    def load(self) -> list[dict[str, str]]:
        return [
            {
                "prompt": render_prompt(
                    e["question"], self.tokenizer, self.template, self.system, self.use_chat_template
                )
                + self.assistant_prefix,
                "answer": encode_reference(self.dataset, self.config, seed, size, i, e["answer"]),
                "question": e["question"],
            }
            for seed, size, i, e in self.entries()
        ]
