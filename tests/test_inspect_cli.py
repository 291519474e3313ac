"""``agl rollouts list|show`` and ``agl spans``: what a person sees, from a SQLite file or over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agl import semconv as sc
from agl.cli import main
from agl.store.server import serve_in_thread
from agl.store.sqlite import SQLiteStore
from agl.types import AttemptError, NewRollout, RolloutConfig, Span

TRACE = "ab" * 16


def span(rid: str, i: int, name: str, parent: int | None, start_ms: int, end_ms: int, **kw: object) -> Span:
    return Span(
        trace_id=TRACE,
        span_id=f"{i:016x}",
        parent_id=None if parent is None else f"{parent:016x}",
        name=name,
        start_ns=start_ms * 10**6,
        end_ns=end_ms * 10**6,
        rollout_id=rid,
        attempt=2,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def populated(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """A store with a rollout that failed once (with a traceback), then succeeded with a span tree."""
    path = tmp_path / "agl.db"
    store = SQLiteStore(path)
    done, queued = store.enqueue(
        [
            NewRollout(input={"question": "2+2?"}, group_id="g1", config=RolloutConfig(max_attempts=2)),
            NewRollout(id="ro-waiting", mode="val"),
        ]
    )
    store.claim("worker-1")
    store.finish_attempt(
        done.id,
        1,
        "failed",
        error=AttemptError(type="ValueError", message="bad answer", traceback="Traceback\n  boom"),
    )
    store.claim("worker-2")
    rid = done.id
    store.add_spans(
        [
            span(rid, 1, sc.SPAN_INVOKE_AGENT, None, 0, 1500, attributes={sc.GEN_AI_AGENT_NAME: "writer"}),
            span(
                rid,
                2,
                sc.SPAN_CHAT,
                1,
                10,
                800,
                attributes={sc.GEN_AI_REQUEST_MODEL: "smollm2", sc.AGL_SIDE: sc.SIDE_CLIENT},
            ),
            span(
                rid,
                3,
                sc.SPAN_CHAT,
                2,
                12,
                790,
                attributes={
                    sc.AGL_SIDE: sc.SIDE_SERVER,
                    sc.AGL_LLM_PROMPT_TOKEN_IDS: list(range(120)),
                    sc.AGL_LLM_RESPONSE_TOKEN_IDS: list(range(40)),
                },
            ),
            span(
                rid,
                4,
                sc.SPAN_EXECUTE_TOOL,
                1,
                810,
                900,
                attributes={sc.GEN_AI_TOOL_NAME: "search"},
                status={"code": "ERROR", "message": "tool timed out"},
            ),
            span(
                rid,
                5,
                sc.SPAN_REWARD,
                1,
                1400,
                1400,
                attributes={
                    sc.AGL_REWARD_VALUE: 1.0,
                    sc.AGL_REWARD_NAME: "exact",
                    sc.AGL_REWARD_PRIMARY: True,
                },
            ),
        ]
    )
    store.finish_attempt(rid, 2, "succeeded")
    store.close()
    yield f"sqlite:///{path}", rid, queued.id


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_rollouts_list(populated: tuple[str, str, str], capsys: pytest.CaptureFixture[str]) -> None:
    url, rid, queued = populated
    rc, out, _ = run(capsys, "rollouts", "list", "--store", url)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["ID", "STATUS", "MODE", "REWARD", "ATTEMPTS"]
    row = next(line for line in lines if line.startswith(rid))
    # the final reward and the number of attempts (two: the first failed)
    assert row.split()[1:5] == ["succeeded", "train", "1", "2"], row
    assert "g1" in row and "ValueError: bad answer" in row
    queued_row = next(line for line in lines if line.startswith(queued))
    assert queued_row.split()[1:5] == ["queued", "val", "-", "0"], queued_row
    assert lines[-1] == "2 rollout(s): 1 queued, 1 succeeded"
    rc, out, _ = run(capsys, "rollouts", "list", "--store", url, "--status", "queued", "--json")
    assert rc == 0 and [r["id"] for r in json.loads(out)] == [queued]


def test_rollouts_show(populated: tuple[str, str, str], capsys: pytest.CaptureFixture[str]) -> None:
    url, rid, _ = populated
    rc, out, _ = run(capsys, "rollouts", "show", rid, "--store", url, "--traceback")
    assert rc == 0
    assert f"rollout   {rid}" in out and "status    succeeded" in out and "max attempts 2" in out
    assert '"question": "2+2?"' in out
    first = next(line for line in out.splitlines() if line.strip().startswith("#1"))
    second = next(line for line in out.splitlines() if line.strip().startswith("#2"))
    assert "failed" in first and "worker-1" in first and "0 span(s)" in first
    assert "succeeded" in second and "worker-2" in second and "5 span(s)" in second
    assert "error: ValueError: bad answer" in out and "  boom" in out
    rc, _, err = run(capsys, "rollouts", "show", "ro-nope", "--store", url)
    assert rc == 2 and "ro-nope" in err and "not found" in err


def test_span_tree(populated: tuple[str, str, str], capsys: pytest.CaptureFixture[str]) -> None:
    url, rid, queued = populated
    rc, out, _ = run(capsys, "spans", rid, "--store", url)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == f"rollout {rid} attempt 2 (succeeded): 5 span(s)"

    def line_of(needle: str) -> str:
        return next(line for line in lines if needle in line)

    def depth(line: str) -> int:
        return len(line) - len(line.lstrip(" "))

    agent, client, server = line_of("[agent]"), line_of("(client)"), line_of("(server)")
    tool, reward = line_of("[tool]"), line_of("[reward]")
    assert "writer" in agent and agent.rstrip().endswith("1.5s")
    assert "[llm] chat smollm2 (client)" in client and "tokens 120->40" in server
    assert "search" in tool and "ERROR: tool timed out" in tool
    assert "exact=1.0" in reward and "(primary)" in reward
    assert depth(agent) < depth(client) < depth(server)
    assert depth(tool) == depth(reward) == depth(client)
    assert (
        lines.index(client) < lines.index(server) < lines.index(tool) < lines.index(reward)
    )  # by start time

    rc, out, _ = run(capsys, "spans", rid, "--store", url, "--attempt", "1")
    assert rc == 0 and "attempt 1 (failed): 0 span(s)" in out and "(no spans)" in out
    rc, out, _ = run(capsys, "spans", rid, "--store", url, "--json")
    assert rc == 0 and [s["seq"] for s in json.loads(out)] == [1, 2, 3, 4, 5]
    rc, out, _ = run(capsys, "spans", queued, "--store", url)
    assert rc == 0 and "no attempts yet" in out


def test_over_http_and_from_the_environment(
    populated: tuple[str, str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, rid, _ = populated
    store = SQLiteStore(url.removeprefix("sqlite:///"))
    with serve_in_thread(store, token="t0k") as http_url:
        monkeypatch.setenv("AGL_STORE", http_url)
        monkeypatch.setenv("AGL_STORE_TOKEN", "t0k")
        rc, out, _ = run(capsys, "spans", rid)
        assert rc == 0 and "[tool] execute_tool search" in out
        rc, _, err = run(capsys, "rollouts", "list", "--token", "wrong")
        assert rc == 2 and "invalid bearer token" in err
    store.close()


def test_missing_sqlite_file_is_an_error_not_a_new_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AGL_STORE", raising=False)
    rc, _, err = run(capsys, "rollouts", "list")
    assert rc == 2 and "no store at 'agl.db'" in err
    assert not (tmp_path / "agl.db").exists()
