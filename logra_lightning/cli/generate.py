"""``logra generate``: completions of a checkpoint or a model directory, and held-out pass@k with a reward.

Run::

    logra generate --ckpt_path best --config my_task.yaml --prompt "12+30="         # (--config: where `best` is)
    logra generate --ckpt_path runs/x/version_0/checkpoints/last.ckpt --prompt "12+30=" --n 4 --temperature 1.0
    logra generate --model exported/ --prompt "What is 2+3?" --max_new_tokens 64    # an export or any HF directory
    logra generate --model exported/ --data test.parquet --prompt_key question --answer_key solution \\
        --reward my_reward.py:score --n 8                                           # pass@1, pass@k, greedy

A checkpoint is turned into a model in a temporary directory (the path ``logra export`` takes, so
nothing is left behind); the in-process Hugging Face engine samples (``--threads`` sets torch's
threads). With ``--data`` and ``--reward`` it scores ``n`` sampled completions per problem and the
greedy one, and prints greedy accuracy and the unbiased pass@k (Chen et al., 2021) for k = 1, 2,
4, ..., n: a problem counts as solved by a sample whose reward is at least ``--correct_reward``.
Rewards get the records' fields as in training (:mod:`~logra_lightning.rewards.fields`).

Example::

    >>> pass_at_k(n=4, c=1, k=1), pass_at_k(n=4, c=1, k=4), pass_at_k(n=4, c=0, k=2)
    (0.25, 1.0, 0.0)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from math import comb

from logra_lightning.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 < k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in 1..n={n}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def _ks(n: int) -> list[int]:
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks + ([n] if ks[-1] != n else [])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and status 2, like every other logra start-up error
        raise ConfigError(f"logra generate: {message} (logra generate --help lists the options)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="logra generate", description="Completions of a checkpoint or model directory; pass@k.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt_path", help="a checkpoint of logra fit, or last / best (with --config)")
    src.add_argument("--model", help="an HF directory (an export), builtin:<name>, or a cached hub id")
    p.add_argument("--config", action="append", default=[], help="the fit's config: where last / best are looked up")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    what.add_argument("--data", help="a .jsonl/.json/.parquet/.csv of problems (logra_lightning.data.TableSource)")
    p.add_argument("--prompt_key", default="prompt")
    p.add_argument("--answer_key", default="answer")
    p.add_argument("--limit", type=int, default=None, help="the first problems of --data only")
    p.add_argument("--reward", default=None, help="with --data: my_reward.py:fn, module.fn or a class path")
    p.add_argument("--correct_reward", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt (pass@k up to k = n)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1 is fastest for tiny models)")
    p.add_argument("--no_chat_template", action="store_true", help="send the prompts as they are")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    return p


def _load(args, work: str):
    from logra_lightning.builtin import resolve_model
    from logra_lightning.models import load_policy

    if args.ckpt_path:
        from logra_lightning.cli.checkpoints import resolve_ckpt_path
        from logra_lightning.io.export import export_checkpoint

        model_dir = str(export_checkpoint(resolve_ckpt_path(args.ckpt_path, args.config, "generate"), f"{work}/policy"))
    else:
        model_dir = resolve_model(args.model)
    return load_policy(model_dir)


def main(argv: Sequence[str]) -> int:
    """``logra generate ...``; returns 0, raises :class:`~logra_lightning.errors.ConfigError` on a mistake."""
    args = parser().parse_args(list(argv))
    if args.n < 1 or args.max_new_tokens < 1:
        raise ConfigError(f"--n={args.n}, --max_new_tokens={args.max_new_tokens}: both must be >= 1")
    if args.reward and not args.data:
        raise ConfigError("--reward scores --data problems; give --data FILE (with --prompt only completions print)")
    import torch

    from logra_lightning.data.template import render_prompt
    from logra_lightning.rollout import HFEngine, SamplingConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    records = None
    if args.data:
        from logra_lightning.data import TableSource

        source = TableSource(
            args.data, args.prompt_key, args.answer_key, limit=args.limit, use_chat_template=not args.no_chat_template
        )
    with tempfile.TemporaryDirectory() as work:
        model, tokenizer = _load(args, work)
    model.eval()
    if args.data:
        source.tokenizer = tokenizer
        records = source.load()
        prompts = [r["prompt"] for r in records]
    else:
        prompts = [render_prompt(p, tokenizer, use_chat_template=not args.no_chat_template) for p in args.prompt]
    engine = HFEngine(model, tokenizer)
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, seed=args.seed)
    ids = [tokenizer.encode(p) for p in prompts]
    texts = engine.generate(ids, n=args.n, sampling=sampling).texts  # [B*n], a prompt's samples together
    if records is None or not args.reward:
        for i, prompt in enumerate(prompts):
            samples = texts[i * args.n : (i + 1) * args.n]
            if args.json:
                print(json.dumps({"prompt": prompt, "completions": samples}, ensure_ascii=False))
            else:
                print(f"prompt: {prompt!r}\n" + "".join(f"  [{j}] {t!r}\n" for j, t in enumerate(samples)), end="")
        return 0
    result = _pass_at_k(args, engine, tokenizer, records, texts)
    print(json.dumps(result) if args.json else _report(args, result))
    return 0


def _scores(args, records: list[dict], completions: list[str], repeat: int) -> list[float]:
    from logra_lightning.data.module import collate_records, record_fields, repeat_fields
    from logra_lightning.rewards import as_reward, safe_rewards

    batch = collate_records(records)
    fields = repeat_fields(record_fields(batch), repeat)
    rep = [x for x in batch["prompt"] for _ in range(repeat)], [a for a in batch["answer"] for _ in range(repeat)]
    values, _, _ = safe_rewards(as_reward(args.reward), rep[0], completions, rep[1], fields)
    return [v if v == v else 0.0 for v in values]  # NaN (a None reward): not correct


def _pass_at_k(args, engine, tokenizer, records: list[dict], texts: list[str]) -> dict:
    from logra_lightning.rollout.greedy import greedy_completions

    greedy = greedy_completions(engine, tokenizer, [r["prompt"] for r in records], max_new_tokens=args.max_new_tokens)
    ok = [s >= args.correct_reward for s in _scores(args, records, texts, args.n)]
    correct = [sum(ok[i * args.n : (i + 1) * args.n]) for i in range(len(records))]
    result = {"problems": len(records), "n": args.n, "temperature": args.temperature}
    result["greedy_accuracy"] = sum(s >= args.correct_reward for s in _scores(args, records, greedy, 1)) / len(records)
    for k in _ks(args.n):
        result[f"pass@{k}"] = sum(pass_at_k(args.n, c, k) for c in correct) / len(records)
    return result


def _report(args, r: dict) -> str:
    ks = ", ".join(f"pass@{k} {r[f'pass@{k}']:.1%}" for k in _ks(args.n))
    return (
        f"{r['problems']} problems of {args.data}: greedy accuracy {r['greedy_accuracy']:.1%}; "
        f"{args.n} samples each at temperature {args.temperature}: {ks}"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
