"""``agl export`` and ``agl transitions``: what the adapter would train on, as JSONL or as a table.

``agl export --store URL --format transitions|sft|dpo --out FILE.jsonl`` writes the records
:func:`agl.reports.export.export` makes (formats in that module's docstring and docs/architecture.md §8).
``agl export model RUN_DIR --out DIR`` writes a run's trained policy as a folder to serve, with its
model card (:mod:`agl.reports.model_export`).
``agl transitions ROLLOUT_ID --store URL`` prints, per transition, the agent, the prompt tail and the
response (decoded with ``--tokenizer`` if given), token counts, exactness and the rewards.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from agl.adapter import Adapter, finishing_attempt
from agl.adapter.air_rules import AIR
from agl.adapter.trajectories import merge_transitions
from agl.algorithms.lightning_rl import LightningRL
from agl.cli._util import add_store_args, open_store_from_args, tokenizer_from_arg
from agl.errors import UsageError
from agl.reports.export import FORMATS, FORMS, check_format, export
from agl.types import Rollout, Transition

__all__ = ["print_transitions", "register_cli"]


def _add_common(p: argparse.ArgumentParser) -> None:
    add_store_args(p)
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--agents", help="comma-separated agent names to keep (default: all)")
    sel.add_argument("--agents-regex", help="keep agents whose name fully matches this regular expression")
    sel.add_argument(
        "--adapter",
        metavar="NAME",
        help="an adapter per agent: keep the calls of the agent(s) whose adapter is NAME (what it trains on)",
    )
    p.add_argument(
        "--tokenizer", help="re-tokenise/decode with this tokenizer: 'default' or a local HF directory"
    )
    p.add_argument("--credit", choices=("identical", "discounted"), default="identical")
    p.add_argument("--gamma", type=float, default=1.0, help="discount for --credit discounted")
    p.add_argument("--advantage-level", choices=("rollout", "transition"), default="rollout")
    p.add_argument("--no-air", action="store_true", help="ignore automatic intermediate rewards")
    p.add_argument(
        "--missing-reward", type=float, default=0.0, help="final reward of attempts that reported none"
    )


def register_cli(parser: argparse.ArgumentParser) -> None:
    if parser.prog.split()[-1] == "transitions":
        parser.add_argument("rollout_id", help="the rollout to show")
        parser.add_argument("--attempt", type=int, help="show this attempt (default: the finishing one)")
        parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
        parser.add_argument("--width", type=int, default=160, help="characters of prompt/response to show")
        _add_common(parser)
        parser.set_defaults(func=_cmd_transitions)
    else:
        _add_model_command(parser)
        parser.add_argument(
            "--format", choices=FORMATS, dest="fmt", help="transitions, sft or dpo (required)"
        )
        parser.add_argument(
            "--form",
            choices=FORMS,
            default="transitions",
            help="for --format transitions: one record per LLM call (default) or per merged agent "
            "conversation (trajectories: what the update trains on)",
        )
        parser.add_argument("--out", help="output JSONL file ('-' for stdout; required)")
        parser.add_argument("--min-reward", type=float, help="keep rollouts whose final reward is >= this")
        parser.add_argument(
            "--rollouts", help="comma-separated rollout ids (default: every finished rollout)"
        )
        parser.add_argument("--mode", choices=("train", "val", "test"))
        _add_common(parser)
        parser.set_defaults(func=_cmd_export)


def _adapter_from_args(args: argparse.Namespace) -> Adapter:
    agents: Any = None
    if args.agents is not None:
        agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    elif args.agents_regex is not None:
        agents = args.agents_regex
    elif args.adapter is not None:
        from agl.lora import lora_pattern

        agents = lora_pattern(args.adapter)
    tokenizer = tokenizer_from_arg(args.tokenizer) if args.tokenizer else None
    # the flags' values are checked by LightningRL and Adapter: a refusal is a UsageError, one line
    algorithm = LightningRL(credit=args.credit, gamma=args.gamma, advantage_level=args.advantage_level)
    return Adapter(
        agents=agents,
        tokenizer=tokenizer,
        air=AIR.off() if args.no_air else AIR(),
        missing_reward=args.missing_reward,
        algorithm=algorithm,
    )


def _selection(args: argparse.Namespace) -> str | None:
    for flag in ("agents", "agents_regex", "adapter"):
        value = getattr(args, flag, None)
        if value is not None:
            return f"--{flag.replace('_', '-')} {value!r}"
    return None


def _say_if_nothing_selected(args: argparse.Namespace, stats: Any) -> None:
    """A selection that matched none of the LLM calls says which agent names the spans hold (on stderr,
    so --json output stays clean): the likely cause is a misspelt or differently written name."""
    selection = _selection(args)
    if selection is None or not stats.llm_calls or stats.unselected < stats.llm_calls:
        return
    seen = ", ".join(f"{name or '<no agent span>'} ({n})" for name, n in sorted(stats.agents.items()))
    print(
        f"agl: {selection} matches none of the {stats.llm_calls} LLM call(s); the agents that made them: "
        f"{seen}",
        file=sys.stderr,
    )


def _add_model_command(parser: argparse.ArgumentParser) -> None:
    """``agl export model RUN_DIR --out DIR``: the trained policy as a folder to serve (beside the
    data exports, which keep their flags: ``agl export --format ... --out FILE``)."""
    sub = parser.add_subparsers(dest="export_command", metavar="model")
    m = sub.add_parser(
        "model",
        help="the trained policy as a folder to load or serve, with its model card",
        description="Export a run's trained policy (a LoRA adapter, one per agent, the merged model or a "
        "full fine-tune) with a model card that states the run: agl.reports.model_export.",
    )
    m.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory (its checkpoints/) or a checkpoint folder"
    )
    m.add_argument("--out", required=True, help="the new folder to write (must not exist or be empty)")
    pick = m.add_mutually_exclusive_group()
    pick.add_argument(
        "--step", type=int, metavar="N", help="export checkpoint-N (default: the last checkpoint)"
    )
    pick.add_argument(
        "--best",
        action="store_true",
        help="export the checkpoint with the best held-out reward (metrics.jsonl)",
    )
    m.add_argument(
        "--merge", action="store_true", help="LoRA runs: the base model with the adapter merged in"
    )
    m.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="the merged weights' dtype")
    m.add_argument("--base", metavar="DIR", help="the base model's folder, when it moved since the run")
    m.set_defaults(func=_cmd_export_model)


def _cmd_export_model(args: argparse.Namespace) -> int:
    from agl.reports.model_card import serve_commands
    from agl.reports.model_export import export_model

    result = export_model(
        args.run_dir,
        args.out,
        step=args.step,
        best=args.best,
        merge=args.merge,
        dtype=args.dtype,
        base=args.base,
    )
    ckpt = result.checkpoint
    print(
        f"agl export: {result.kind} from {ckpt.path} (loop step {ckpt.step}, {ckpt.update_step} update(s)) "
        f"-> {result.out}; the card: {result.out / 'README.md'}"
    )
    print("serve it:")
    for command in serve_commands(result.out, result.manifest):
        print(f"  {command}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    for flag, value in (("--format", args.fmt), ("--out", args.out)):
        if value is None:
            raise UsageError(f"agl export needs {flag} (or: agl export model RUN_DIR --out DIR)")
    check_format(args.fmt, args.form)  # before the store is opened or anything written
    adapter = _adapter_from_args(args)
    store = open_store_from_args(args)
    try:
        ids = [i.strip() for i in args.rollouts.split(",") if i.strip()] if args.rollouts else None
        result = export(
            store,
            args.fmt,
            args.out,
            adapter=adapter,
            rollout_ids=ids,
            mode=args.mode,
            min_reward=args.min_reward,
            algorithm=adapter.algorithm,
            progress=sys.stderr.isatty(),
            form=args.form,
        )
    finally:
        store.close()
    _say_if_nothing_selected(args, adapter.stats)
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(result.skipped.items())) or "none"
    what = "trajectories" if args.form == "trajectories" else args.fmt
    print(
        f"wrote {result.records} {what} record(s) to {args.out} from {result.rollouts} rollout(s), "
        f"{result.transitions} transition(s); skipped: {skipped}",
        file=sys.stderr,
    )
    if result.merge is not None:
        m = result.merge
        breaks = ", ".join(f"{c}={n}" for c, n in sorted(m.breaks.items())) or "none"
        print(
            f"merged {m.calls} call(s) into {m.sequences} sequence(s): merge rate {m.merge_rate:.2f}, "
            f"{m.tokens_saved} token(s) saved; prefix breaks: {breaks}",
            file=sys.stderr,
        )
    return 0


def _short(text: str, width: int, *, tail: bool = False) -> str:
    text = text.replace("\n", "\\n")
    if len(text) <= width:
        return text
    return "…" + text[-(width - 1) :] if tail else text[: width - 1] + "…"


def _prompt_tail(t: Transition, tok: Any) -> str:
    if tok is not None and t.prompt_ids:
        return str(tok.decode(list(t.prompt_ids[-96:])))
    if t.messages:
        last = t.messages[-1]
        content = last.get("content")
        if not isinstance(content, str):
            content = json.dumps(content if content is not None else last.get("tool_calls"))
        return f"[{last.get('role')}] {content}"
    return ""


def _response(t: Transition, tok: Any) -> str:
    if tok is not None and t.response_ids:
        return str(tok.decode(list(t.response_ids)))
    return t.response_text or ""


def print_transitions(
    rollout: Rollout,
    attempt: int | None,
    ts: Sequence[Transition],
    adapter: Adapter,
    *,
    width: int,
    file: TextIO,
) -> None:
    st = adapter.last_stats
    final = ts[0].final_reward if ts else None
    print(
        f"rollout {rollout.id}  status={rollout.status}  attempt={attempt}  group={rollout.group_id}  "
        f"final_reward={final}  transitions={len(ts)}  exact={st.exact}  retokenised={st.retokenised}",
        file=file,
    )
    notes = {
        k: v
        for k, v in st.as_dict().items()
        if v
        and k
        in (
            "missing_final_reward",
            "no_tokenizer",
            "unselected",
            "duplicates",
            "orphans",
            "stale",
            "failed_calls",
            "retokenise_failed",
            "unattached_rewards",
        )
    }
    if st.air:
        notes["air"] = st.air
    if notes:
        print(f"  notes: {notes}", file=file)
    if st.no_tokenizer and adapter.tokenizer is None:
        print(
            f"  {st.no_tokenizer} LLM call(s) were recorded client-side without exact token ids: pass "
            "--tokenizer default (or a local tokenizer directory) to re-tokenise them",
            file=file,
        )
    seq_of: dict[int, tuple[int, str | None]] = {}
    if ts:
        trajs, _ = merge_transitions(ts)
        seq_of = {seg.transition: (k, seg.break_cause) for k, tr in enumerate(trajs) for seg in tr.segments}
        breaks = ", ".join(f"{c}={n}" for c, n in sorted(st.prefix_breaks.items())) or "none"
        print(
            f"  merged: {st.transitions} call(s) -> {st.sequences} sequence(s), merge rate "
            f"{st.merge_rate:.2f}, {st.tokens_saved} token(s) saved "
            f"({st.tokens_per_call} per call -> {st.tokens_merged}); prefix breaks: {breaks}",
            file=file,
        )
    tok = adapter.tokenizer
    for pos, t in enumerate(ts):
        seq, cause = seq_of.get(pos, (None, None))
        print(
            f"#{t.index:<3} agent={t.agent}  exact={'yes' if t.exact else 'no'}  seq={seq}"
            + (f" (break: {cause})" if cause else "")
            + f"  prompt={len(t.prompt_ids)} tok  response={len(t.response_ids)} tok  "
            f"intermediate={t.intermediate_reward:+.3f}  final={t.final_reward:+.3f}  return={t.reward:+.3f}  "
            f"span={t.span_id}" + (f"  seed={t.seed} ({t.seed_source})" if t.seed is not None else ""),
            file=file,
        )
        print(f"     prompt   {_short(_prompt_tail(t, tok), width, tail=True)}", file=file)
        print(f"     response {_short(_response(t, tok), width)}", file=file)


def _cmd_transitions(args: argparse.Namespace) -> int:
    adapter = _adapter_from_args(args)
    store = open_store_from_args(args)
    try:
        rollout = store.get_rollout(args.rollout_id)
        attempt = args.attempt if args.attempt is not None else finishing_attempt(rollout)
        if attempt is None and rollout.attempts:
            attempt = rollout.attempts[-1].number  # still running: show what it has so far
        spans = store.query_spans(rollout_id=rollout.id, attempt=attempt) if attempt is not None else []
    finally:
        store.close()
    ts = adapter.transitions(spans, rollout=rollout, attempt=attempt) if attempt is not None else []
    _say_if_nothing_selected(args, adapter.last_stats)
    if args.json:
        for t in ts:
            print(json.dumps(t.model_dump(mode="json"), ensure_ascii=False))
        return 0
    print_transitions(rollout, attempt, ts, adapter, width=args.width, file=sys.stdout)
    if ts:
        from agl.reports.exactness import exactness_report, format_report

        print(f"  {format_report(exactness_report(ts, spans))}", file=sys.stdout)
    return 0
