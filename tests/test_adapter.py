"""Adapter: hand-built span sets for every case of DESIGN §8, plus property tests on messy traces."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl import semconv as sc
from agl.adapter import Adapter, finishing_attempt
from agl.adapter.air_rules import AIR
from agl.algorithms.lightning_rl import LightningRL
from agl.types import Attempt, NewRollout, Rollout, Span, SpanEvent, SpanStatus

# ------------------------------------------------------------------------------------ span builder


class Attempt1:
    """Builds the spans of one attempt the way the integrations and the gateway record them."""

    def __init__(self, rollout_id: str = "ro-1", attempt: int = 1, seed: int = 0) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.spans: list[Span] = []
        self._rng = random.Random(seed)
        self.trace_id = self._hex(16)

    def _hex(self, nbytes: int) -> str:
        return "".join(f"{self._rng.randrange(1, 256):02x}" for _ in range(nbytes))

    def span(
        self,
        name: str,
        start: int,
        end: int,
        parent: Span | None = None,
        *,
        attrs: dict | None = None,
        status: str = "UNSET",
        status_message: str | None = None,
        events: tuple[SpanEvent, ...] = (),
        trace_id: str | None = None,
        parent_id: str | None = None,
        resource: dict | None = None,
    ) -> Span:
        s = Span(
            trace_id=trace_id or (parent.trace_id if parent is not None else self.trace_id),
            span_id=self._hex(8),
            parent_id=parent_id
            if parent_id is not None
            else (parent.span_id if parent is not None else None),
            name=name,
            start_ns=start,
            end_ns=end,
            status=SpanStatus(code=status, message=status_message),
            attributes=attrs or {},
            events=events,
            resource=resource or {"service.name": "agent"},
            rollout_id=self.rollout_id,
            attempt=self.attempt,
            seq=len(self.spans) + 1,
        )
        self.spans.append(s)
        return s

    def root(self, start: int = 0, end: int = 10_000) -> Span:
        return self.span(sc.SPAN_ROLLOUT, start, end)

    def agent(self, name: str, start: int, end: int, parent: Span | None = None, **kw) -> Span:
        attrs = {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: name}
        return self.span(sc.SPAN_INVOKE_AGENT, start, end, parent, attrs=attrs, **kw)

    def client(
        self,
        start: int,
        end: int,
        parent: Span | None,
        messages: list[dict] | None = None,
        output: dict | None = None,
        **kw,
    ) -> Span:
        attrs = {
            sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
            sc.AGL_SIDE: sc.SIDE_CLIENT,
            sc.GEN_AI_REQUEST_MODEL: "m",
            sc.GEN_AI_INPUT_MESSAGES: json.dumps(messages or [{"role": "user", "content": "hi"}]),
        }
        if output is not None:
            attrs[sc.GEN_AI_OUTPUT_MESSAGES] = json.dumps([output])
        attrs.update(kw.pop("attrs", {}))
        return self.span(sc.SPAN_CHAT, start, end, parent, attrs=attrs, **kw)

    def server(
        self,
        start: int,
        end: int,
        parent: Span | None,
        prompt: list[int],
        response: list[int],
        *,
        output: dict | None = None,
        messages: list[dict] | None = None,
        logprobs: list[float] | None = None,
        exact: bool = True,
        **kw,
    ) -> Span:
        attrs = {
            sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
            sc.AGL_SIDE: sc.SIDE_SERVER,
            sc.GEN_AI_REQUEST_MODEL: "m",
            sc.GEN_AI_INPUT_MESSAGES: json.dumps(messages or [{"role": "user", "content": "hi"}]),
            sc.GEN_AI_OUTPUT_MESSAGES: json.dumps([output or {"role": "assistant", "content": "ok"}]),
            sc.AGL_LLM_PROMPT_TOKEN_IDS: prompt,
            sc.AGL_LLM_RESPONSE_TOKEN_IDS: response,
            sc.AGL_LLM_RESPONSE_LOGPROBS: logprobs if logprobs is not None else [-0.5] * len(response),
            sc.AGL_LLM_EXACT: exact,
            sc.AGL_LLM_WEIGHT_VERSION: 3,
        }
        attrs.update(kw.pop("attrs", {}))
        return self.span(
            sc.SPAN_CHAT, start, end, parent, attrs=attrs, resource={"service.name": "gateway"}, **kw
        )

    def call(
        self, start: int, end: int, parent: Span | None, prompt: list[int], response: list[int], **kw
    ) -> Span:
        """A client span with its gateway child (the normal case); returns the server span."""
        output = kw.pop("output", None) or {"role": "assistant", "content": f"answer {response}"}
        c = self.client(start, end, parent, output=output)
        return self.server(start + 1, end - 1, c, prompt, response, output=output, **kw)

    def tool(
        self,
        start: int,
        end: int,
        parent: Span | None,
        name: str = "t",
        call_id: str | None = None,
        error=False,
    ) -> Span:
        attrs = {sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL, sc.GEN_AI_TOOL_NAME: name}
        if call_id is not None:
            attrs[sc.GEN_AI_TOOL_CALL_ID] = call_id
        events: tuple[SpanEvent, ...] = ()
        if error:
            events = (
                SpanEvent(
                    name="exception",
                    time_ns=end,
                    attributes={
                        sc.AGL_EXCEPTION_TYPE: "ToolError",
                        sc.AGL_EXCEPTION_MESSAGE: f"{name} failed",
                    },
                ),
            )
        return self.span(
            sc.SPAN_EXECUTE_TOOL,
            start,
            end,
            parent,
            attrs=attrs,
            status="ERROR" if error else "OK",
            status_message=f"ToolError: {name} failed" if error else None,
            events=events,
        )

    def reward(
        self, value: float, t: int, parent: Span | None = None, primary: bool = True, source="emit"
    ) -> Span:
        attrs = {
            sc.AGL_REWARD_VALUE: value,
            sc.AGL_REWARD_NAME: "reward",
            sc.AGL_REWARD_PRIMARY: primary,
            sc.AGL_REWARD_SOURCE: source,
        }
        return self.span(sc.SPAN_REWARD, t, t, parent, attrs=attrs)


def tool_call_msg(*ids: str, args: str = '{"x": 1}') -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "t", "arguments": args}} for i in ids
        ],
    }


def key(ts) -> list[tuple]:
    return [(t.span_id, t.index, t.prompt_ids, t.response_ids, t.reward, t.intermediate_reward) for t in ts]


# ------------------------------------------------------------------------------------ basics


def test_gateway_span_is_one_exact_transition() -> None:
    a = Attempt1()
    root = a.root()
    ag = a.agent("writer", 10, 900, root)
    srv = a.call(100, 200, ag, [1, 2, 3], [4, 5], logprobs=[-0.1, -0.2])
    a.reward(1.0, 950, root)
    adapter = Adapter()
    (t,) = adapter.transitions(a.spans)
    assert t.prompt_ids == (1, 2, 3) and t.response_ids == (4, 5)
    assert t.response_logprobs == (-0.1, -0.2)
    assert t.exact is True and t.agent == "writer" and t.index == 0
    assert t.span_id == srv.span_id and t.rollout_id == "ro-1" and t.attempt == 1
    assert t.final_reward == 1.0 and t.intermediate_reward == 0.0 and t.reward == 1.0
    assert t.messages == ({"role": "user", "content": "hi"},)
    assert t.response_text == "answer [4, 5]" and t.weight_version == 3 and t.model == "m"
    assert adapter.last_stats.transitions == 1 and adapter.last_stats.exact == 1
    # the model is valid: a validated copy equals it
    assert type(t).model_validate(t.model_dump()) == t


def test_order_by_start_time_and_index_after_selection() -> None:
    a = Attempt1()
    root = a.root()
    w = a.agent("writer", 10, 5000, root)
    c = a.agent("checker", 10, 5000, root)
    a.call(300, 400, w, [3], [3])
    a.call(100, 200, w, [1], [1])
    a.call(200, 250, c, [2], [2])
    a.reward(0.5, 6000, root)
    spans = list(a.spans)
    random.Random(1).shuffle(spans)
    ts = Adapter().transitions(spans)
    assert [t.prompt_ids for t in ts] == [(1,), (2,), (3,)]
    assert [t.index for t in ts] == [0, 1, 2]
    only = Adapter(agents=["writer"]).transitions(spans)
    assert [t.prompt_ids for t in only] == [(1,), (3,)]
    assert [t.index for t in only] == [0, 1]
    assert all(t.agent == "writer" for t in only)


def test_ties_in_start_time_are_broken_by_seq() -> None:
    a = Attempt1()
    ag = a.agent("a", 0, 1000)
    first = a.call(100, 200, ag, [1], [1])
    second = a.call(100, 200, ag, [2], [2])
    ts = Adapter().transitions(list(reversed(a.spans)))
    assert [t.span_id for t in ts] == [first.span_id, second.span_id]


def test_agent_selection_by_list_regex_and_none() -> None:
    a = Attempt1()
    root = a.root()
    for i, name in enumerate(["writer", "rewriter", "checker"]):
        ag = a.agent(name, 100 * i, 100 * i + 90, root)
        a.call(100 * i + 10, 100 * i + 50, ag, [i], [i])
    a.call(500, 600, root, [9], [9])  # an LLM call outside any agent
    assert {t.agent for t in Adapter().transitions(a.spans)} == {"writer", "rewriter", "checker", None}
    assert [t.agent for t in Adapter(agents=["writer", "rewriter"]).transitions(a.spans)] == [
        "writer",
        "rewriter",
    ]
    assert [t.agent for t in Adapter(agents=".*writer").transitions(a.spans)] == ["writer", "rewriter"]
    assert [t.agent for t in Adapter(agents="writer").transitions(a.spans)] == ["writer"]  # full match only
    assert [t.agent for t in Adapter(agents=re.compile("check.*")).transitions(a.spans)] == ["checker"]
    adapter = Adapter(agents=[])
    assert adapter.transitions(a.spans) == []
    assert adapter.last_stats.unselected == 4
    with pytest.raises(ValueError, match="regular expression"):
        Adapter(agents="(")


def test_nested_agents_nearest_wins() -> None:
    a = Attempt1()
    outer = a.agent("planner", 0, 1000)
    a.call(10, 20, outer, [1], [1])
    inner = a.agent("researcher", 30, 500, outer)
    tool = a.tool(40, 400, inner, "search")
    deeper = a.span("some.framework.step", 50, 300, tool)
    a.call(60, 100, deeper, [2], [2])
    ts = Adapter().transitions(a.spans)
    assert [(t.prompt_ids, t.agent) for t in ts] == [((1,), "planner"), ((2,), "researcher")]


def test_agent_name_from_span_name_when_attribute_missing() -> None:
    a = Attempt1()
    ag = a.span("invoke_agent critic", 0, 100, attrs={sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT})
    a.call(10, 20, ag, [1], [1])
    assert Adapter().transitions(a.spans)[0].agent == "critic"


# ------------------------------------------------------------------------------------ re-tokenising


@pytest.fixture(scope="module")
def chat_tokenizer():
    pytest.importorskip("tokenizers")
    from agl.chat.tokenizer import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="module")
def hf_tokenizer(chat_tokenizer):
    transformers = pytest.importorskip("transformers")
    from importlib import resources

    assets = resources.files("agl.chat").joinpath("assets")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(assets.joinpath("tokenizer.json")),
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
    )
    tok.chat_template = assets.joinpath("chat_template.jinja").read_text()
    return tok


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def _client_only(output: dict | None = None) -> tuple[Attempt1, Span]:
    a = Attempt1()
    ag = a.agent("solver", 0, 1000)
    c = a.client(10, 90, ag, MSGS, output or {"role": "assistant", "content": "4"})
    a.reward(1.0, 999)
    return a, c


def test_hf_tokenizer_retokenises_tool_call_conversations(chat_tokenizer, hf_tokenizer) -> None:
    """SmolLM2's own HF template cannot render assistant tool calls; the adapter renders as the gateway does."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "2"})
    a = Attempt1()
    ag = a.agent("solver", 0, 1000)
    a.client(10, 90, ag, history, {"role": "assistant", "content": "4"})
    a.reward(1.0, 999)
    (t,) = Adapter(tokenizer=hf_tokenizer).transitions(a.spans)
    (t_agl,) = Adapter(tokenizer=chat_tokenizer).transitions(a.spans)
    assert t.exact is False and t.prompt_ids == t_agl.prompt_ids and t.response_ids == t_agl.response_ids
    assert "add" in chat_tokenizer.decode(t.prompt_ids)


def test_client_span_without_gateway_child_is_retokenised(chat_tokenizer) -> None:
    a, c = _client_only()
    (t,) = Adapter(tokenizer=chat_tokenizer).transitions(a.spans)
    prompt_text = chat_tokenizer.render(MSGS, add_generation_prompt=True)
    assert t.prompt_ids == tuple(chat_tokenizer.encode(prompt_text))
    assert chat_tokenizer.decode(t.response_ids) == "4<|im_end|>"
    assert t.exact is False and t.response_logprobs is None and t.span_id == c.span_id
    assert t.agent == "solver" and t.final_reward == 1.0


def test_hf_tokenizer_duck_type_gives_the_same_ids(chat_tokenizer, hf_tokenizer) -> None:
    a, _ = _client_only()
    (t_hf,) = Adapter(tokenizer=hf_tokenizer).transitions(a.spans)
    (t_agl,) = Adapter(tokenizer=chat_tokenizer).transitions(a.spans)
    direct = hf_tokenizer.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)
    direct = direct["input_ids"] if hasattr(direct, "keys") else direct
    assert t_hf.prompt_ids == tuple(direct) == t_agl.prompt_ids
    assert t_hf.response_ids == t_agl.response_ids


def test_tokenizer_accepts_what_the_cli_accepts_and_refuses_the_rest(chat_tokenizer, tmp_path) -> None:
    a, _ = _client_only()
    (t_default,) = Adapter(tokenizer="default").transitions(a.spans)
    (t_agl,) = Adapter(tokenizer=chat_tokenizer).transitions(a.spans)
    assert t_default.prompt_ids == t_agl.prompt_ids and t_default.response_ids == t_agl.response_ids
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        Adapter(tokenizer=str(tmp_path / "no-such-dir"))
    with pytest.raises(ValueError, match="tokenizer must be 'default', a local tokenizer directory"):
        Adapter(tokenizer=42)


def test_unattributed_calls_counted_only_when_the_attempts_spans_show_an_agent_framework() -> None:
    """Gateway calls with no agent span, in an attempt whose own spans show an agent framework ran (a
    span with ``agl.integration`` other than ``openai``): its hooks were bypassed and agent selection
    will miss. Read from the spans, not this process's plugin registry: a plain OpenAI-client agent is
    not flagged although an agent framework is instrumented here (the reported false alarm), and a
    framework's attempt is flagged although nothing is instrumented in this process (external runners)."""
    pytest.importorskip("langchain_core")  # the agent framework instrumented below
    import agl

    def plain_calls(a: Attempt1, parent: Span) -> None:
        for start in (100, 300):
            c = a.client(start, start + 100, parent, attrs={sc.AGL_INTEGRATION: "openai"})
            a.server(start + 1, start + 99, c, [1, 2], [3])

    lost = Attempt1()
    chain = lost.span("chain RunnableSequence", 50, 900, lost.root(), attrs={sc.AGL_INTEGRATION: "langchain"})
    plain_calls(lost, chain)
    plain = Attempt1(rollout_id="ro-2")
    plain_calls(plain, plain.root())
    fine = Attempt1(rollout_id="ro-3")
    ag = fine.agent("writer", 10, 900, fine.root())
    plain_calls(fine, ag)
    was_on = "langchain" in agl.instrumentation.registry.instrumented()
    if was_on:
        agl.uninstrument("langchain")
    adapter = Adapter()
    try:
        adapter.transitions(lost.spans)  # nothing instrumented in this process: the spans tell
        assert adapter.last_stats.unattributed_calls == 2 and adapter.last_stats.agents == {"": 2}
        agl.instrument("langchain")
        adapter.transitions(plain.spans)  # plain client code: no agent spans expected
        assert adapter.last_stats.unattributed_calls == 0 and adapter.last_stats.agents == {"": 2}
        adapter.transitions(fine.spans)
        assert adapter.last_stats.unattributed_calls == 0 and adapter.last_stats.agents == {"writer": 2}
    finally:
        agl.instrument("langchain") if was_on else agl.uninstrument("langchain")
    assert adapter.stats.unattributed_calls == 2 and adapter.stats.agents == {"": 4, "writer": 2}


def test_without_tokenizer_client_only_calls_are_skipped_and_counted() -> None:
    a, _ = _client_only()
    adapter = Adapter()
    assert adapter.transitions(a.spans) == []
    assert adapter.last_stats.no_tokenizer == 1 and adapter.last_stats.llm_calls == 1


def test_passthrough_server_span_is_retokenised(chat_tokenizer) -> None:
    a = Attempt1()
    ag = a.agent("solver", 0, 1000)
    c = a.client(10, 90, ag, MSGS, {"role": "assistant", "content": "4"})
    srv = a.span(
        sc.SPAN_CHAT,
        11,
        89,
        c,
        attrs={
            sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
            sc.AGL_SIDE: sc.SIDE_SERVER,
            sc.AGL_LLM_EXACT: False,
            sc.GEN_AI_INPUT_MESSAGES: json.dumps(MSGS),
            sc.GEN_AI_OUTPUT_MESSAGES: json.dumps([{"role": "assistant", "content": "4"}]),
        },
    )
    adapter = Adapter(tokenizer=chat_tokenizer)
    (t,) = adapter.transitions(a.spans)
    assert t.exact is False and t.span_id == srv.span_id
    assert t.prompt_ids == tuple(chat_tokenizer.encode(chat_tokenizer.render(MSGS)))
    assert adapter.last_stats.retokenised == 1


def test_otel_parts_messages_are_normalised(chat_tokenizer) -> None:
    a = Attempt1()
    parts_in = [{"role": "user", "parts": [{"type": "text", "content": "What is 2+2?"}]}]
    parts_out = {"role": "assistant", "parts": [{"type": "text", "content": "4"}], "finish_reason": "stop"}
    a.client(10, 90, None, parts_in, parts_out)
    (t,) = Adapter(tokenizer=chat_tokenizer).transitions(a.spans)
    assert t.messages == ({"role": "user", "content": "What is 2+2?"},)
    assert t.response_text == "4"


def test_nested_client_spans_make_one_transition(chat_tokenizer) -> None:
    """A framework's chat span wrapping the openai client's chat span: only the innermost counts."""
    a = Attempt1()
    outer = a.client(10, 100, None, MSGS, {"role": "assistant", "content": "4"})
    inner = a.client(20, 90, outer, MSGS, {"role": "assistant", "content": "4"})
    (t,) = Adapter(tokenizer=chat_tokenizer).transitions(a.spans)
    assert t.span_id == inner.span_id


# ------------------------------------------------------------------------------------ messy traces


def test_spans_from_several_processes_and_dropped_traceparent() -> None:
    """The gateway (another process) lost the traceparent: its span is a root of its own trace. It is
    joined to the client span by response id, attributed, and not duplicated."""
    a = Attempt1()
    ag = a.agent("writer", 0, 1000)
    c = a.client(
        10, 90, ag, output={"role": "assistant", "content": "x"}, attrs={sc.GEN_AI_RESPONSE_ID: "r-1"}
    )
    srv = a.server(
        11,
        89,
        None,
        [1, 2],
        [3],
        trace_id="f" * 32,
        attrs={sc.GEN_AI_RESPONSE_ID: "r-1"},
    )
    adapter = Adapter()
    (t,) = adapter.transitions(a.spans)
    assert t.span_id == srv.span_id and t.agent == "writer" and t.exact
    assert adapter.last_stats.relinked == 1
    assert c.span_id != srv.span_id


def test_orphans_attach_to_their_trace_root() -> None:
    a = Attempt1()
    root = a.agent("main", 0, 1000)
    # the client span was never exported: the server span's parent is missing
    srv = a.server(10, 20, None, [1], [2], parent_id="1234567890abcdef")
    adapter = Adapter()
    (t,) = adapter.transitions(a.spans)
    assert t.span_id == srv.span_id and t.agent == "main"
    assert adapter.last_stats.orphans == 1
    assert root.parent_id is None


def test_orphan_in_a_trace_without_root_and_late_parent() -> None:
    a = Attempt1()
    ag = a.agent("main", 0, 1000)
    srv = a.server(10, 20, ag, [1], [2])
    late = [s for s in a.spans if s.span_id != ag.span_id]
    (t,) = Adapter().transitions(late)  # the parent has not arrived: still one transition
    assert t.agent is None and t.span_id == srv.span_id
    (t2,) = Adapter().transitions([*late, ag])  # it arrived: attributed
    assert t2.agent == "main"


def test_parent_cycles_do_not_hang_or_crash() -> None:
    a = Attempt1()
    x = a.span("x", 0, 10, parent_id="aaaaaaaaaaaaaaaa")
    y = a.span("y", 0, 10, parent_id=x.span_id)
    # make x's parent y: a two-span cycle
    x2 = x.model_copy(update={"parent_id": y.span_id})
    srv = a.server(1, 2, None, [1], [1], parent_id=y.span_id)
    adapter = Adapter()
    (t,) = adapter.transitions([x2, y, srv])
    assert t.span_id == srv.span_id and adapter.last_stats.cycles == 1
    self_parent = srv.model_copy(update={"parent_id": srv.span_id})
    assert len(Adapter().transitions([self_parent])) == 1


def test_duplicated_spans_yield_one_transition() -> None:
    a = Attempt1()
    ag = a.agent("w", 0, 100)
    srv = a.call(10, 20, ag, [1], [2])
    a.reward(1.0, 99)
    copies = [s.model_copy(update={"seq": (s.seq or 0) + 100}) for s in a.spans]
    adapter = Adapter()
    ts = adapter.transitions([*a.spans, *copies, srv])
    assert [t.span_id for t in ts] == [srv.span_id]
    assert adapter.last_stats.duplicates == len(a.spans) + 1
    assert ts[0].final_reward == 1.0


def test_only_the_finishing_attempt_counts_and_stale_spans_are_ignored() -> None:
    old = Attempt1(attempt=1, seed=1)
    ag = old.agent("w", 0, 100)
    old.call(10, 20, ag, [1], [1])
    stale = [s.model_copy(update={"stale": True}) for s in old.spans]
    new = Attempt1(attempt=2, seed=2)
    ag2 = new.agent("w", 200, 300)
    srv = new.call(210, 220, ag2, [2], [2])
    new.reward(1.0, 299)
    rollout = Rollout(
        id="ro-1",
        group_id="g",
        attempts=(
            Attempt(rollout_id="ro-1", number=1, status="lost"),
            Attempt(rollout_id="ro-1", number=2, status="succeeded"),
        ),
    )
    adapter = Adapter()
    (t,) = adapter.transitions([*stale, *new.spans], rollout=rollout)
    assert t.span_id == srv.span_id and t.attempt == 2 and t.group_id == "g"
    assert adapter.last_stats.stale == len(stale)
    # without a rollout the highest attempt wins; an explicit attempt overrides
    assert [t.attempt for t in Adapter().transitions([*old.spans, *new.spans])] == [2]
    assert [t.prompt_ids for t in Adapter().transitions([*old.spans, *new.spans], attempt=1)] == [(1,)]
    # a rollout with no finished attempt yields nothing
    running = rollout.model_copy(update={"attempts": (Attempt(rollout_id="ro-1", number=1),)})
    assert Adapter().transitions(new.spans, rollout=running) == []


def test_finishing_attempt_prefers_succeeded_then_failed() -> None:
    def ro(*statuses: str) -> Rollout:
        atts = tuple(Attempt(rollout_id="r", number=i + 1, status=s) for i, s in enumerate(statuses))
        return Rollout(id="r", attempts=atts)

    assert finishing_attempt(ro("failed", "succeeded")) == 2
    assert finishing_attempt(ro("succeeded", "lost")) == 1
    assert finishing_attempt(ro("failed", "timed_out", "failed")) == 3
    assert finishing_attempt(ro("lost", "running")) is None
    assert finishing_attempt(ro()) is None


def test_spans_of_several_rollouts_need_a_rollout() -> None:
    a, b = Attempt1("ro-a"), Attempt1("ro-b", seed=5)
    a.call(0, 10, None, [1], [1])
    b.call(0, 10, None, [2], [2])
    with pytest.raises(ValueError, match="2 rollouts"):
        Adapter().transitions([*a.spans, *b.spans])
    adapter = Adapter()
    (t,) = adapter.transitions([*a.spans, *b.spans], rollout=Rollout(id="ro-b"))
    assert t.prompt_ids == (2,) and adapter.last_stats.other_attempt == 2


def test_failed_llm_call_without_response_is_not_a_transition() -> None:
    a = Attempt1()
    ag = a.agent("w", 0, 100)
    a.client(10, 20, ag, status="ERROR")
    adapter = Adapter()
    assert adapter.transitions(a.spans) == []
    assert adapter.last_stats.failed_calls == 1


def test_bad_logprobs_and_message_json_are_dropped_not_fatal() -> None:
    a = Attempt1()
    srv = a.server(0, 10, None, [1], [2, 3], logprobs=[-1.0])
    broken = srv.model_copy(update={"attributes": {**srv.attributes, sc.GEN_AI_INPUT_MESSAGES: "{not json"}})
    adapter = Adapter()
    (t,) = adapter.transitions([broken])
    assert t.response_logprobs is None and t.messages == ()
    assert adapter.last_stats.logprobs_dropped == 1 and adapter.last_stats.bad_messages == 1


# ------------------------------------------------------------------------------------ rewards


def test_final_reward_is_last_primary_and_earlier_rewards_attach_to_preceding_call() -> None:
    a = Attempt1()
    root = a.root()
    ag = a.agent("w", 10, 9000, root)
    first = a.call(100, 200, ag, [1], [1])
    a.reward(0.3, 250, ag, primary=False)  # after call 1
    second = a.call(300, 400, ag, [2], [2])
    a.reward(0.2, 450, ag)  # a primary reward, but not the last one: intermediate of call 2
    a.reward(0.1, 460, ag, primary=False)  # also call 2
    a.reward(1.0, 9500, root, source="return")  # the runner's record of the return value: final
    adapter = Adapter()
    t1, t2 = adapter.transitions(a.spans)
    assert (t1.span_id, t2.span_id) == (first.span_id, second.span_id)
    assert t1.final_reward == t2.final_reward == 1.0
    assert t1.intermediate_reward == pytest.approx(0.3)
    assert t2.intermediate_reward == pytest.approx(0.3)
    assert t1.reward == pytest.approx(1.3) and t2.reward == pytest.approx(1.3)  # identical: R + r_j
    assert adapter.last_stats.intermediate_rewards == 3 and adapter.last_stats.reward_spans == 4


def test_final_reward_is_one_total_order_and_ignores_stale_spans() -> None:
    """The one definition (agl.adapter.final_reward, also what the dashboard and the adapter's own
    transitions use), where the two old copies disagreed: two primary rewards ending together with no
    store order were picked by reading order in the dashboard's copy (here: the earlier one first read),
    and a stale reward span that ended last won in the adapter's copy."""
    from agl.adapter import final_reward

    a = Attempt1()
    a.call(0, 10, None, [1], [1])

    def primary(value: float, start: int, end: int) -> Span:
        attrs = {sc.AGL_REWARD_VALUE: value, sc.AGL_REWARD_PRIMARY: True}
        return a.span(sc.SPAN_REWARD, start, end, attrs=attrs).model_copy(update={"seq": None})

    early, late = primary(0.25, 20, 50), primary(0.75, 30, 50)  # same end, no seq: the later start wins
    spans = [*a.spans[:2], early, late]
    for order in (spans, spans[::-1]):
        assert final_reward(order) == 0.75
        (t,) = Adapter().transitions(order)
        assert t.final_reward == 0.75 and t.intermediate_reward == 0.25
    stale = primary(5.0, 40, 90).model_copy(update={"stale": True})
    assert final_reward([*spans, stale]) == 0.75
    assert final_reward([stale]) is None and final_reward(a.spans[:2]) is None


def test_reward_before_any_call_is_unattached_and_missing_final_is_filled() -> None:
    a = Attempt1()
    a.reward(0.5, 5, primary=False)
    a.call(100, 200, None, [1], [1])
    adapter = Adapter(missing_reward=-1.0)
    (t,) = adapter.transitions(a.spans)
    assert t.final_reward == -1.0 and t.intermediate_reward == 0.0
    assert adapter.last_stats.missing_final_reward == 1 and adapter.last_stats.unattached_rewards == 1
    with pytest.raises(ValueError):
        Adapter(missing_reward=float("nan"))


def test_invalid_reward_values_are_counted() -> None:
    a = Attempt1()
    a.call(0, 10, None, [1], [1])
    r = a.reward(1.0, 20)
    bad = r.model_copy(update={"attributes": {**r.attributes, sc.AGL_REWARD_VALUE: "high"}})
    adapter = Adapter()
    (t,) = adapter.transitions([a.spans[0], a.spans[1], bad])
    assert t.final_reward == 0.0 and adapter.last_stats.invalid_rewards == 1


def test_credit_rule_of_the_algorithm_is_applied() -> None:
    a = Attempt1()
    ag = a.agent("w", 0, 1000)
    a.call(10, 20, ag, [1], [1])
    a.reward(0.5, 25, ag, primary=False)
    a.call(30, 40, ag, [2], [2])
    a.reward(2.0, 999)
    cfg = LightningRL(credit="discounted", gamma=0.5)
    ts = Adapter(algorithm=cfg).transitions(a.spans)
    # G_2 = 0 + 0.5 * 2 = 1.0 ; G_1 = 0.5 + 0.5 * 1.0 = 1.0
    assert [t.reward for t in ts] == [pytest.approx(1.0), pytest.approx(1.0)]
    plain = Adapter(include_intermediate=False).transitions(a.spans)
    assert [t.reward for t in plain] == [2.0, 2.0]


# ------------------------------------------------------------------------------------ AIR


def _tool_scenario(error_ids: set[str], *, with_ids: bool = True) -> tuple[Attempt1, Span, Span]:
    """Call 1 issues two parallel tool calls; both tools run; call 2 follows."""
    a = Attempt1()
    ag = a.agent("w", 0, 10_000)
    first = a.call(100, 200, ag, [1], [1], output=tool_call_msg("call_a", "call_b"))
    for k, cid in enumerate(("call_a", "call_b")):
        a.tool(300 + k, 400 + k * 50, ag, f"tool_{cid}", cid if with_ids else None, error=cid in error_ids)
    second = a.call(600, 700, ag, [2], [2])
    a.reward(1.0, 9999)
    return a, first, second


def test_failed_tool_penalises_the_call_that_issued_it() -> None:
    a, first, second = _tool_scenario({"call_b"})
    adapter = Adapter()
    t1, t2 = adapter.transitions(a.spans)
    assert t1.intermediate_reward == pytest.approx(-0.1) and t2.intermediate_reward == 0.0
    assert t1.reward == pytest.approx(0.9) and t2.reward == 1.0
    assert adapter.last_stats.air == {"tool_error": 1}


def test_tool_issuer_by_id_even_when_time_says_otherwise() -> None:
    """A tool started after call 2 ended, but its call id belongs to call 1: the id wins."""
    a = Attempt1()
    ag = a.agent("w", 0, 10_000)
    a.call(100, 200, ag, [1], [1], output=tool_call_msg("call_x"))
    a.call(300, 400, ag, [2], [2])
    a.tool(500, 600, ag, "slow", "call_x", error=True)
    t1, t2 = Adapter().transitions(a.spans)
    assert t1.intermediate_reward == pytest.approx(-0.1) and t2.intermediate_reward == 0.0


def test_tool_issuer_falls_back_to_time_without_ids() -> None:
    a, first, second = _tool_scenario({"call_a", "call_b"}, with_ids=False)
    t1, t2 = Adapter().transitions(a.spans)
    assert t1.intermediate_reward == pytest.approx(-0.2) and t2.intermediate_reward == 0.0


def test_tool_success_bonus_and_weights() -> None:
    a, _, _ = _tool_scenario({"call_b"})
    t1, _ = Adapter(air=AIR(tool_success=0.05, tool_error=-0.5)).transitions(a.spans)
    assert t1.intermediate_reward == pytest.approx(0.05 - 0.5)
    t1, _ = Adapter(air=AIR(tool_error=None)).transitions(a.spans)
    assert t1.intermediate_reward == 0.0
    t1, _ = Adapter(air=AIR.off()).transitions(a.spans)
    assert t1.intermediate_reward == 0.0
    t1, _ = Adapter(air=None).transitions(a.spans)
    assert t1.intermediate_reward == 0.0
    with pytest.raises(ValueError, match="AIR"):
        Adapter(air={"tool_error": -1})
    with pytest.raises(ValueError, match="tool_error"):
        AIR(tool_error=float("inf"))


def test_exception_span_penalises_the_call_before_it_once() -> None:
    a = Attempt1()
    root = a.root()
    ag = a.agent("w", 10, 5000, root, status="ERROR")
    a.call(100, 200, ag, [1], [1])
    second = a.call(300, 400, ag, [2], [2])
    exc_attrs = {sc.AGL_EXCEPTION_TYPE: "ValueError", sc.AGL_EXCEPTION_MESSAGE: "bad parse"}
    a.span(
        sc.SPAN_EXCEPTION,
        450,
        450,
        ag,
        attrs=exc_attrs,
        status="ERROR",
        events=(SpanEvent(name="exception", time_ns=450, attributes=exc_attrs),),
    )
    # the same exception propagates to the agent span and the rollout span: counted once
    ev = SpanEvent(name="exception", time_ns=4999, attributes=exc_attrs)
    a.spans[1] = a.spans[1].model_copy(update={"events": (ev,)})
    a.spans[0] = a.spans[0].model_copy(update={"status": SpanStatus(code="ERROR"), "events": (ev,)})
    adapter = Adapter()
    t1, t2 = adapter.transitions(a.spans)
    assert t1.intermediate_reward == 0.0 and t2.intermediate_reward == pytest.approx(-0.1)
    assert t2.span_id == second.span_id and adapter.last_stats.air == {"exception": 1}


def test_tool_exception_propagating_up_is_not_counted_again() -> None:
    a = Attempt1()
    ag = a.agent("w", 0, 5000)
    a.call(100, 200, ag, [1], [1], output=tool_call_msg("c1"))
    tool = a.tool(300, 400, ag, "boom", "c1", error=True)
    ev = tool.events[0]
    a.spans[0] = ag.model_copy(update={"status": SpanStatus(code="ERROR"), "events": (ev,)})
    adapter = Adapter()
    (t,) = adapter.transitions(a.spans)
    assert t.intermediate_reward == pytest.approx(-0.1)
    assert adapter.last_stats.air == {"tool_error": 1}


def test_agent_exception_not_from_a_tool_is_counted() -> None:
    a = Attempt1()
    ev = SpanEvent(name="exception", time_ns=4000, attributes={sc.AGL_EXCEPTION_TYPE: "KeyError"})
    ag = a.agent("w", 0, 5000, status="ERROR", events=(ev,))
    a.call(100, 200, ag, [1], [1])
    a.tool(300, 400, ag, "fine", None)
    (t,) = Adapter().transitions(a.spans)
    assert t.intermediate_reward == pytest.approx(-0.1)


def test_malformed_tool_call_arguments_penalise_the_call_itself() -> None:
    a = Attempt1()
    ag = a.agent("w", 0, 5000)
    a.call(100, 200, ag, [1], [1], output=tool_call_msg("c1", args='{"x": '))
    a.call(300, 400, ag, [2], [2])
    adapter = Adapter()
    t1, t2 = adapter.transitions(a.spans)
    assert t1.intermediate_reward == pytest.approx(-0.1) and t2.intermediate_reward == 0.0
    # when the framework also reports the failing tool, the call is penalised once
    a.tool(250, 260, ag, "t", "c1", error=True)
    t1, _ = Adapter().transitions(a.spans)
    assert t1.intermediate_reward == pytest.approx(-0.1)


def test_air_penalty_on_an_unselected_agent_is_dropped_and_counted() -> None:
    a = Attempt1()
    w = a.agent("writer", 0, 500)
    a.call(10, 20, w, [1], [1])
    c = a.agent("checker", 600, 900)
    a.call(610, 620, c, [2], [2])
    a.tool(630, 640, c, "sql", None, error=True)
    adapter = Adapter(agents=["writer"])
    (t,) = adapter.transitions(a.spans)
    assert t.intermediate_reward == 0.0 and adapter.last_stats.unselected_rewards == 1


class _LengthPenalty:
    """A real pluggy plugin: penalises every LLM response longer than two tokens."""

    from agl.plugins import hookimpl

    @hookimpl
    def agl_intermediate_reward(self, span, spans):
        ids = span.attributes.get(sc.AGL_LLM_RESPONSE_TOKEN_IDS)
        if span.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER and ids is not None and len(ids) > 2:
            assert any(s.span_id == span.span_id for s in spans)
            return -0.25
        return None


class _Broken:
    from agl.plugins import hookimpl

    @hookimpl
    def agl_intermediate_reward(self, span, spans):
        if span.name == sc.SPAN_EXECUTE_TOOL:
            raise RuntimeError("plugin bug")
        return None


def test_plugin_rules_through_the_hook() -> None:
    from agl.plugins import get_plugin_manager

    pm = get_plugin_manager()
    plugin, broken = _LengthPenalty(), _Broken()
    pm.register(plugin)
    pm.register(broken)
    try:
        a = Attempt1()
        ag = a.agent("w", 0, 1000)
        a.call(10, 20, ag, [1], [1, 2, 3])
        a.call(30, 40, ag, [2], [4])
        a.tool(50, 60, ag, "t")
        adapter = Adapter()
        t1, t2 = adapter.transitions(a.spans)
        assert t1.intermediate_reward == pytest.approx(-0.25) and t2.intermediate_reward == 0.0
        assert adapter.last_stats.air.get("plugin") == 1 and adapter.last_stats.plugin_errors == 1
        t1, _ = Adapter(air=AIR(use_plugins=False)).transitions(a.spans)
        assert t1.intermediate_reward == 0.0
    finally:
        pm.unregister(plugin)
        pm.unregister(broken)


# ------------------------------------------------------------------------------------ store


def test_from_store_uses_the_finishing_attempt() -> None:
    from agl.store import open as open_store
    from agl.store.base import NotFoundError

    store = open_store("memory://")
    from agl.types import RolloutConfig

    (ro,) = store.enqueue([NewRollout(group_id="g1", config=RolloutConfig(max_attempts=2))])
    claim = store.claim("w1")
    first = Attempt1(ro.id, claim.attempt.number, seed=1)
    first.call(0, 10, None, [1], [1])
    store.add_spans(first.spans)
    store.finish_attempt(ro.id, 1, "failed")
    claim = store.claim("w1")
    assert claim.attempt.number == 2
    second = Attempt1(ro.id, 2, seed=2)
    srv = second.call(0, 10, None, [2], [2])
    second.reward(1.0, 20)
    store.add_spans(second.spans)
    store.finish_attempt(ro.id, 2, "succeeded")
    adapter = Adapter()
    (t,) = adapter.from_store(store, [ro.id])
    assert t.span_id == srv.span_id and t.attempt == 2 and t.group_id == "g1" and t.final_reward == 1.0
    with pytest.raises(NotFoundError, match="nope"):
        adapter.from_store(store, ["nope"])


def test_from_store_takes_rollouts_and_reads_each_attempt_once() -> None:
    """Rollout objects are used as handed over (no query for them), ids still work, and the final reward
    of a rollout that made no LLM call comes from the spans already read (no third query)."""
    from agl.store import open as open_store

    store = open_store("memory://")
    ro_call, ro_none = store.enqueue([NewRollout(), NewRollout()])
    for with_call in (True, False):
        claim = store.claim("w1")
        att = Attempt1(claim.rollout.id, claim.attempt.number)
        if with_call:
            att.call(0, 10, None, [1], [1])
        att.reward(0.5 if with_call else 0.25, 20)
        store.add_spans(att.spans)
        store.finish_attempt(claim.rollout.id, claim.attempt.number, "succeeded")
    done = {r.id: r for r in store.query_rollouts(ids=[ro_call.id, ro_none.id])}
    calls: list[str] = []
    for name in ("query_rollouts", "query_spans"):
        real = getattr(store, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        setattr(store, name, counted)
    adapter = Adapter(missing_reward=-1.0)
    (t,) = adapter.from_store(store, [done[ro_call.id], done[ro_none.id]])
    assert t.final_reward == 0.5 and calls == ["query_spans", "query_spans"]
    assert adapter.rollout_reward(store, done[ro_none.id]) == 0.25 and len(calls) == 2
    (t2,) = adapter.from_store(store, [ro_call.id, ro_none.id])  # ids: looked up once, together
    assert t2 == t and calls[2:] == ["query_rollouts", "query_spans", "query_spans"]
    other = Adapter()
    assert other.rollout_reward(store, done[ro_none.id]) == 0.25 and calls[-1] == "query_spans"
    with pytest.raises(ValueError, match="rollout ids"):
        adapter.from_store(store, [42])


# ------------------------------------------------------------------------------------ properties


@st.composite
def attempts(draw):
    """A random but well-formed attempt: agents, LLM calls (client+server or client only), tools,
    rewards; returns (spans, number of LLM calls)."""
    seed = draw(st.integers(0, 2**16))
    a = Attempt1(seed=seed)
    root = a.root(0, 10**6)
    t = 10
    n_calls = 0
    for ag_i in range(draw(st.integers(0, 3))):
        ag = a.agent(f"agent{ag_i % 2}", t, t + 10**5, root)
        for _ in range(draw(st.integers(0, 4))):
            if draw(st.booleans()):
                a.call(t + 1, t + 50, ag, [n_calls, 1], [2, n_calls], output=tool_call_msg(f"c{n_calls}"))
            else:
                a.client(t + 1, t + 50, ag, output={"role": "assistant", "content": "x"})
            n_calls += 1
            if draw(st.booleans()):
                a.tool(t + 60, t + 70, ag, "t", f"c{n_calls - 1}", error=draw(st.booleans()))
            if draw(st.booleans()):
                a.reward(draw(st.floats(-1, 1)), t + 80, ag, primary=draw(st.booleans()))
            t += 100
        t += 10
    if draw(st.booleans()):
        a.reward(1.0, t + 1, root)
    return a.spans, n_calls


def _mess(spans: list[Span], data) -> list[Span]:
    out = list(spans)
    out += data.draw(st.lists(st.sampled_from(spans), max_size=len(spans))) if spans else []
    orphaned = data.draw(st.sets(st.integers(0, max(len(out) - 1, 0)), max_size=5)) if out else set()
    out = [
        s.model_copy(update={"parent_id": "0123456789abcdef"}) if i in orphaned and s.parent_id else s
        for i, s in enumerate(out)
    ]
    random.Random(data.draw(st.integers(0, 1000))).shuffle(out)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attempts(), st.data())
def test_property_messy_traces_never_crash_or_duplicate(attempt, data) -> None:
    spans, n_calls = attempt
    messy = _mess(spans, data)
    adapter = Adapter()
    ts = adapter.transitions(messy)
    ids = [t.span_id for t in ts]
    assert len(ids) == len(set(ids))
    assert len(ts) <= n_calls
    assert [t.index for t in ts] == list(range(len(ts)))
    assert all(t.exact for t in ts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attempts(), st.data())
def test_property_shuffling_and_duplicating_change_nothing(attempt, data) -> None:
    spans, _ = attempt
    base = Adapter().transitions(spans)
    shuffled = list(spans) + data.draw(
        st.lists(st.sampled_from(spans), max_size=10) if spans else st.just([])
    )
    random.Random(data.draw(st.integers(0, 1000))).shuffle(shuffled)
    assert key(Adapter().transitions(shuffled)) == key(base)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),  # span index
            st.one_of(st.none(), st.integers(0, 5)),  # parent index
            st.sampled_from([sc.SPAN_CHAT, sc.SPAN_INVOKE_AGENT, sc.SPAN_EXECUTE_TOOL, sc.SPAN_REWARD, "x"]),
            st.integers(0, 100),
            st.booleans(),
        ),
        max_size=20,
    )
)
def test_property_arbitrary_graphs_never_crash(rows) -> None:
    """Random parent graphs (cycles, self-parents, duplicates with different content)."""
    ids = [f"{i + 1:016x}" for i in range(6)]
    spans = []
    for i, (sid, pid, name, t, err) in enumerate(rows):
        attrs: dict = {}
        if name == sc.SPAN_CHAT:
            attrs = {
                sc.AGL_SIDE: sc.SIDE_SERVER,
                sc.AGL_LLM_PROMPT_TOKEN_IDS: [i],
                sc.AGL_LLM_RESPONSE_TOKEN_IDS: [i],
            }
        elif name == sc.SPAN_REWARD:
            attrs = {sc.AGL_REWARD_VALUE: float(t)}
        spans.append(
            Span(
                trace_id="a" * 32,
                span_id=ids[sid],
                parent_id=None if pid is None else ids[pid],
                name=name,
                start_ns=t,
                end_ns=t + 5,
                status=SpanStatus(code="ERROR" if err else "UNSET"),
                attributes=attrs,
                rollout_id="ro-1",
                attempt=1,
                seq=i + 1,
            )
        )
    ts = Adapter(air=AIR(tool_success=0.1)).transitions(spans)
    assert len({t.span_id for t in ts}) == len(ts) <= 6


# ------------------------------------------------------------------------------------ end to end


def test_end_to_end_gateway_openai_client_and_air() -> None:
    """Real gateway (scripted backend, real tokenizer), real openai client instrumented by agl, spans
    exported to a real store: every LLM call is one exact transition with the gateway's ids, attributed
    to its agent, and the failing tool call penalises the call that issued it."""
    openai = pytest.importorskip("openai")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Status, StatusCode

    import agl
    from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call
    from agl.store.memory import MemoryStore
    from agl.tracing import provider as tracing
    from agl.tracing.emit import emit_reward

    store = MemoryStore()
    (ro,) = store.enqueue([NewRollout(group_id="g")])
    claim = store.claim("w")
    provider = TracerProvider()
    tracing.setup_tracing(store, provider)
    agl.instrument("openai", tracer_provider=provider)
    backend = ScriptedBackend(
        [reply(None, tool_call("div", a=1, b=0, id="call_div")), reply("cannot divide")]
    )
    try:
        with serve_gateway(backend, store) as url:
            client = openai.OpenAI(base_url=url.for_rollout(ro.id, claim.attempt.number), api_key="x")
            tracer = provider.get_tracer("test")
            with tracing.rollout_context(ro.id, claim.attempt.number):
                attrs = {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: "calc"}
                with tracer.start_as_current_span(sc.SPAN_INVOKE_AGENT, attributes=attrs):
                    msgs = [{"role": "user", "content": "1/0?"}]
                    first = client.chat.completions.create(model="scripted", messages=msgs)
                    call = first.choices[0].message.tool_calls[0]
                    tool_attrs = {
                        sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
                        sc.GEN_AI_TOOL_NAME: "div",
                        sc.GEN_AI_TOOL_CALL_ID: call.id,
                    }
                    with tracer.start_as_current_span(
                        sc.SPAN_EXECUTE_TOOL, attributes=tool_attrs
                    ) as tool_span:
                        tool_span.set_status(Status(StatusCode.ERROR, "ZeroDivisionError"))
                    msgs += [first.choices[0].message.model_dump(exclude_none=True)]
                    msgs += [{"role": "tool", "tool_call_id": call.id, "content": "error: division by zero"}]
                    client.chat.completions.create(model="scripted", messages=msgs)
                emit_reward(0.25)
            assert tracing.flush(10)
        store.finish_attempt(ro.id, claim.attempt.number, "succeeded")
        adapter = Adapter()
        ts = adapter.from_store(store, [ro.id])
        servers = [
            s
            for s in store.query_spans(rollout_id=ro.id, name=sc.SPAN_CHAT)
            if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
        ]
        assert len(ts) == 2 == len(servers)
        servers.sort(key=lambda s: s.start_ns)
        for t, s in zip(ts, servers, strict=True):
            assert t.exact and t.agent == "calc" and t.span_id == s.span_id
            assert list(t.prompt_ids) == s.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
            assert list(t.response_ids) == s.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
            assert t.final_reward == 0.25 and t.group_id == "g"
        assert ts[0].intermediate_reward == pytest.approx(-0.1) and ts[1].intermediate_reward == 0.0
        assert ts[1].response_text == "cannot divide"
        assert adapter.last_stats.air == {"tool_error": 1}
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
        provider.shutdown()
        store.close()
