"""The dashboard's ASGI app: static pages plus a small JSON API over any :class:`agl.store.Store`.

Served two ways: ``agl dashboard --store URL`` (its own process, reading a store through its URL),
and under ``/ui`` of ``agl store serve`` (the server's own store, in process). Either way it uses only
the Store protocol, and it is read-only except ``POST /api/rollouts/{id}/cancel``.

Auth follows the store server's rules: with a token, every ``/api/`` request must carry
``Authorization: Bearer <token>`` (constant-time comparison), else 401 with a JSON error; the page
itself and its static files hold no data and load without one, then ask the user for the token
when the API answers 401. Handlers are plain functions: Starlette runs them in worker threads, so a
slow store call never blocks the event loop (the store server's long-polls included).
"""

from __future__ import annotations

import hmac
import math
import time
from collections import OrderedDict
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agl.adapter.failures import attempt_kind, deciding_attempt, failure_kind
from agl.dashboard.index import Filters, RolloutIndex
from agl.dashboard.views import (
    KEY_METRICS,
    read_run,
    rollout_view,
    span_detail,
    span_tree,
    trajectories_view,
    transitions_view,
)
from agl.reports.exactness import exactness_report
from agl.store.base import StoreError
from agl.types import ROLLOUT_STATUSES, TERMINAL_ROLLOUT_STATUSES

__all__ = ["Dashboard", "create_dashboard_app", "static_dir"]

#: longest a browser's change long-poll is held (the page re-asks at once; no timer in between)
LONG_POLL_S = 25.0
PAGE_LIMIT_MAX = 500
_MODES = ("train", "val", "test")


def static_dir() -> Path:
    return Path(str(resources.files("agl.dashboard").joinpath("static")))


class _BadRequest(Exception):
    pass


def _error(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _float(q: Any, name: str) -> float | None:
    raw = q.get(name)
    if raw in (None, ""):
        return None
    try:
        v = float(raw)
    except ValueError:
        raise _BadRequest(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(v):
        raise _BadRequest(f"{name} must be finite, got {raw!r}")
    return v


def _int(q: Any, name: str, default: int | None = None, lo: int = 0, hi: int = 2**62) -> int | None:
    raw = q.get(name)
    if raw in (None, ""):
        return default
    try:
        v = int(raw)
    except ValueError:
        raise _BadRequest(f"{name} must be an integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise _BadRequest(f"{name} must be between {lo} and {hi}, got {v}")
    return v


class Dashboard:
    """The API handlers over one store (and optionally a trainer run directory)."""

    def __init__(
        self,
        store: Any,
        *,
        token: str | None = None,
        run_dirs: list[str | Path] | None = None,
        tokenizer: Any = None,
        index: RolloutIndex | None = None,
        store_label: str = "",
        compare: Any = None,
    ) -> None:
        from agl.dashboard.compare import Comparison

        self.store = store
        #: run B of ``agl dashboard --compare`` (an :class:`agl.reports.diff.Run`), or None
        self.compare = Comparison(compare, tokenizer=tokenizer) if compare is not None else None
        self._expected = f"Bearer {token}".encode() if token else None
        self.run_dirs = [Path(d) for d in (run_dirs or [])]
        self.tokenizer = tokenizer
        self.index = index or RolloutIndex(store)
        self.store_label = store_label
        self._spans_cache: OrderedDict[tuple[str, int], list[Any]] = OrderedDict()

    # ---------------------------------------------------------------- plumbing
    def _authorized(self, request: Request) -> bool:
        if self._expected is None:
            return True
        got = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(got, self._expected)

    def _wrap(self, fn: Any) -> Any:
        def endpoint(request: Request) -> Response:
            if not self._authorized(request):
                missing = not request.headers.get("authorization")
                return _error(
                    401, "unauthorized", "missing bearer token" if missing else "invalid bearer token"
                )
            try:
                return fn(request)
            except _BadRequest as exc:
                return _error(400, "invalid_input", str(exc))
            except StoreError as exc:
                status = exc.status if exc.status < 500 else 502
                if exc.status == 401:  # the store refused the dashboard's own token: a setup problem
                    status = 502
                return _error(status, exc.code, str(exc))

        return endpoint

    def _spans(self, rollout_id: str, attempt: int, terminal: bool) -> list[Any]:
        """An attempt's spans; a finished rollout's are cached (a few attempts), a running one re-read."""
        key = (rollout_id, attempt)
        cached = self._spans_cache.get(key)
        if cached is not None:
            self._spans_cache.move_to_end(key)
            return cached
        spans = self.store.query_spans(rollout_id=rollout_id, attempt=attempt)
        if terminal:
            self._spans_cache[key] = spans
            while len(self._spans_cache) > 8:
                self._spans_cache.popitem(last=False)
        return spans

    # ---------------------------------------------------------------- handlers
    def info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "store": self.store_label,
                "run_dirs": [str(d) for d in self.run_dirs],
                "tokenizer": self.tokenizer is not None,
                "statuses": list(ROLLOUT_STATUSES),
                "modes": list(_MODES),
                "compare": self.compare.label if self.compare is not None else None,
            }
        )

    def runs(self, request: Request) -> Response:
        curve, pending = self.index.reward_curve()
        return JSONResponse(
            {
                "runs": [read_run(d) for d in self.run_dirs],
                "store_curve": curve,
                "rewards_pending": pending,
                "key_metrics": [list(m) for m in KEY_METRICS],
            }
        )

    def version_metrics(self, request: Request) -> Response:
        """Training-data metrics of one resources version's train rollouts, from the store: what the
        adapter makes of them (exact-token ratio, AIR share) and how many groups carry no signal."""
        from agl.adapter import Adapter, finishing_attempt
        from agl.adapter.air_rules import AIR

        version = _int(request.query_params, "version")
        mode = request.query_params.get("mode") or "train"
        if mode not in _MODES:
            raise _BadRequest(f"unknown mode {mode!r}; expected one of {', '.join(_MODES)}")
        cap = _int(request.query_params, "max_rollouts", 256, lo=1, hi=4096) or 256
        rows = [
            r for r in self.index.rows_of_version(version, mode) if r["status"] in TERMINAL_ROLLOUT_STATUSES
        ]
        rows = rows[-cap:]
        rollouts = self.store.query_rollouts(ids=[r["id"] for r in rows]) if rows else []
        adapter = Adapter(tokenizer=self.tokenizer)
        plain = Adapter(tokenizer=self.tokenizer, air=AIR.off())
        n = exact = with_air = 0
        all_ts: list[Any] = []
        all_spans: list[Any] = []
        finals: dict[str, list[float]] = {}
        for r in rollouts:
            att = finishing_attempt(r)
            if att is None:
                continue
            spans = self._spans(r.id, att, True)
            ts = adapter.transitions(spans, rollout=r, attempt=att)
            base = {
                (t.span_id, t.index): t.intermediate_reward
                for t in plain.transitions(spans, rollout=r, attempt=att)
            }
            n += len(ts)
            exact += sum(t.exact for t in ts)
            all_ts.extend(ts)
            all_spans.extend(spans)
            with_air += sum(1 for t in ts if t.intermediate_reward != base.get((t.span_id, t.index), 0.0))
            if ts:
                finals.setdefault(r.group_id or r.id, []).append(ts[0].final_reward)
        groups = [v for v in finals.values() if len(v) > 1]
        report = exactness_report(all_ts, all_spans)
        by_api, by_backend = report["by_api"], report["by_backend"]
        return JSONResponse(
            {
                "version": version,
                "mode": mode,
                "rollouts": len(rollouts),
                "capped": len(self.index.rows_of_version(version, mode)) > cap,
                "transitions": n,
                "exact_token_ratio": exact / n if n else None,
                "exact_by_api": by_api,
                "exact_by_backend": by_backend,
                "air_share": with_air / n if n else None,
                "groups": len(groups),
                "zero_variance_groups": sum(1 for v in groups if max(v) - min(v) < 1e-9),
                "adapter": adapter.stats.as_dict(),
            }
        )

    def rollouts(self, request: Request) -> Response:
        q = request.query_params
        statuses = [s for s in q.getlist("status") if s]
        for s in statuses:
            if s not in ROLLOUT_STATUSES:
                raise _BadRequest(f"unknown status {s!r}; expected one of {', '.join(ROLLOUT_STATUSES)}")
        mode = q.get("mode") or None
        if mode is not None and mode not in _MODES:
            raise _BadRequest(f"unknown mode {mode!r}; expected one of {', '.join(_MODES)}")
        f = Filters(
            status=frozenset(statuses) or None,
            mode=mode,
            resources_version=_int(q, "resources_version"),
            reward_min=_float(q, "reward_min"),
            reward_max=_float(q, "reward_max"),
            group_id=q.get("group_id") or None,
            search=q.get("q") or None,
        )
        if f.reward_min is not None and f.reward_max is not None and f.reward_min > f.reward_max:
            raise _BadRequest("reward_min is above reward_max")
        offset = _int(q, "offset", 0) or 0
        limit = _int(q, "limit", 50, lo=1, hi=PAGE_LIMIT_MAX) or 50
        data = self.index.page(f, offset=offset, limit=limit, newest_first=q.get("order") != "oldest")
        data["facets"] = self.index.facets()
        return JSONResponse(data)

    def changes(self, request: Request) -> Response:
        since = _int(request.query_params, "since", 0, lo=0) or 0
        timeout = _float(request.query_params, "timeout")
        timeout = LONG_POLL_S if timeout is None else min(max(timeout, 0.0), LONG_POLL_S)
        version = self.index.wait_for_change(since, timeout)
        return JSONResponse({"version": version})

    def rollout(self, request: Request) -> Response:
        r = self.store.get_rollout(request.path_params["rollout_id"])
        terminal = r.status in TERMINAL_ROLLOUT_STATUSES
        spans = {a.number: self._spans(r.id, a.number, terminal) for a in r.attempts}
        kind, kinds = None, {}
        if r.status != "cancelled":  # how the trainer treats it and each attempt (agl.adapter.failures)
            kinds = {n: attempt_kind(r, n, s) for n, s in spans.items()}
            if r.done:
                att = deciding_attempt(r)
                kind = failure_kind(r, spans.get(att, []) if att is not None else [])
        counts = {n: len(s) for n, s in spans.items()}
        return JSONResponse(rollout_view(r, counts, time.time(), kind, kinds))

    def _attempt(self, request: Request) -> tuple[Any, int]:
        r = self.store.get_rollout(request.path_params["rollout_id"])
        n = request.path_params["attempt"]
        if not any(a.number == n for a in r.attempts):
            from agl.store.base import NotFoundError

            raise NotFoundError(f"rollout {r.id!r} has no attempt {n}")
        return r, n

    def spans(self, request: Request) -> Response:
        r, n = self._attempt(request)
        spans = self._spans(r.id, n, r.done)
        return JSONResponse(span_tree(spans))

    def span(self, request: Request) -> Response:
        r, n = self._attempt(request)
        sid = request.path_params["span_id"]
        for s in self._spans(r.id, n, r.done):
            if s.span_id == sid:
                return JSONResponse(span_detail(s))
        from agl.store.base import NotFoundError

        raise NotFoundError(f"span {sid!r} not found in rollout {r.id!r} attempt {n}")

    def transitions(self, request: Request) -> Response:
        from agl.adapter import Adapter, finishing_attempt
        from agl.adapter.air_rules import AIR
        from agl.algorithms.lightning_rl import LightningRL, compute_advantages

        r, n = self._attempt(request)
        q = request.query_params
        agents: Any = None
        if q.get("agents"):
            agents = [a.strip() for a in q["agents"].split(",") if a.strip()]
        elif q.get("agents_regex"):
            agents = q["agents_regex"]
        elif q.get("adapter"):  # an adapter per agent: the calls of the agents this adapter serves
            from agl.lora import lora_pattern

            try:
                agents = lora_pattern(q["adapter"])
            except ValueError as exc:
                raise _BadRequest(str(exc)) from None
        weights: dict[str, Any] = {}
        for rule in ("tool_error", "tool_success", "exception", "malformed_tool_call"):
            v = _float(q, f"air_{rule}")
            if v is not None:
                weights[rule] = v
        try:
            air = AIR.off() if q.get("air") == "off" else AIR(**weights)
            adapter = Adapter(agents=agents, tokenizer=self.tokenizer, air=air)
            plain = Adapter(agents=agents, tokenizer=self.tokenizer, air=AIR.off())
        except ValueError as exc:
            raise _BadRequest(str(exc)) from None
        spans = self._spans(r.id, n, r.done)
        ts = adapter.transitions(spans, rollout=r, attempt=n)
        stats = adapter.last_stats.as_dict()
        base = plain.transitions(spans, rollout=r, attempt=n)
        # advantages are relative to the group: adapt the group's other rollouts the same way
        group = list(ts)
        gid = r.group_id
        if gid is not None:
            others = [o for o in self.store.query_rollouts(group_id=gid) if o.id != r.id]
            for o in others[:64]:
                att = finishing_attempt(o)
                if att is not None:
                    group.extend(adapter.transitions(self._spans(o.id, att, o.done), rollout=o, attempt=att))
        advantages: dict[tuple[str, int], float] = {}
        if group:
            values, _ = compute_advantages(group, LightningRL())
            advantages = {
                (t.rollout_id, t.index): a for t, a in zip(group, values, strict=True) if t.rollout_id == r.id
            }
        data = transitions_view(ts, base, advantages, stats, self.tokenizer)
        if q.get("view") == "merged":
            data.update(trajectories_view(ts, advantages, self.tokenizer))
        data["attempt"] = n
        data["finishing_attempt"] = finishing_attempt(r)
        data["group_size"] = len({t.rollout_id for t in group})
        return JSONResponse(data)

    def _comparison(self, request: Request) -> tuple[Any, int]:
        if self.compare is None:
            from agl.store.base import NotFoundError

            raise NotFoundError(
                "this dashboard compares with no other run: start it with agl dashboard --compare RUN "
                "(a run directory, store file or store URL)"
            )
        return self.compare, _int(request.query_params, "tokens", 32, lo=1, hi=4096) or 32

    def rollout_diff(self, request: Request) -> Response:
        """This rollout against the rollout at the same place in the compared run (``agl diff``'s logic)."""
        cmp, tokens = self._comparison(request)
        return JSONResponse(cmp.rollout(self.store, request.path_params["rollout_id"], tokens=tokens))

    def run_diff(self, request: Request) -> Response:
        """The whole run against the compared one: ``agl diff`` (with metrics when one --run-dir is given)."""
        from agl.reports.diff import read_metrics

        cmp, tokens = self._comparison(request)
        metrics = read_metrics(self.run_dirs[0] / "metrics.jsonl") if len(self.run_dirs) == 1 else None
        return JSONResponse(cmp.whole(self.store, metrics=metrics, tokens=tokens))

    def cancel(self, request: Request) -> Response:
        r = self.store.cancel(request.path_params["rollout_id"])
        self.index.want()
        return JSONResponse({"id": r.id, "status": r.status})

    # ---------------------------------------------------------------- routes
    def routes(self) -> list[Any]:
        api = [
            ("/api/info", self.info, "GET"),
            ("/api/runs", self.runs, "GET"),
            ("/api/metrics", self.version_metrics, "GET"),
            ("/api/rollouts", self.rollouts, "GET"),
            ("/api/changes", self.changes, "GET"),
            ("/api/diff", self.run_diff, "GET"),
            ("/api/rollouts/{rollout_id}/diff", self.rollout_diff, "GET"),
            ("/api/rollouts/{rollout_id}", self.rollout, "GET"),
            ("/api/rollouts/{rollout_id}/cancel", self.cancel, "POST"),
            ("/api/rollouts/{rollout_id}/attempts/{attempt:int}/spans", self.spans, "GET"),
            ("/api/rollouts/{rollout_id}/attempts/{attempt:int}/spans/{span_id}", self.span, "GET"),
            ("/api/rollouts/{rollout_id}/attempts/{attempt:int}/transitions", self.transitions, "GET"),
        ]
        index_html = static_dir() / "index.html"

        def page(request: Request) -> Response:
            return FileResponse(index_html, headers={"Cache-Control": "no-cache"})

        def api_404(request: Request) -> Response:
            if not self._authorized(request):
                return _error(401, "unauthorized", "invalid bearer token")
            return _error(404, "no_route", f"no route {request.method} {request.url.path}")

        routes: list[Any] = [Route(p, self._wrap(fn), methods=[m]) for p, fn, m in api]
        routes.append(Route("/api/{rest:path}", api_404, methods=["GET", "POST", "PUT", "DELETE"]))
        routes.append(Route("/", page, methods=["GET"]))
        # browsers ask the origin's /favicon.ico unless the page names an icon (index.html does)
        icon = static_dir() / "favicon.ico"
        routes.append(Route("/favicon.ico", lambda request: FileResponse(icon), methods=["GET"]))
        routes.append(Mount("/static", app=StaticFiles(directory=static_dir()), name="static"))
        return routes

    def close(self) -> None:
        self.index.close()
        if self.compare is not None:
            self.compare.close()


def create_dashboard_app(
    store: Any,
    *,
    token: str | None = None,
    run_dirs: list[str | Path] | None = None,
    tokenizer: Any = None,
    store_label: str = "",
    close_store: bool = False,
    compare: Any = None,
) -> Starlette:
    """The dashboard as an ASGI app (mount it anywhere; its links are relative). ``compare``: a run
    (:func:`agl.reports.diff.open_run`) each rollout is compared with; the app closes its store."""
    import contextlib

    dash = Dashboard(
        store, token=token, run_dirs=run_dirs, tokenizer=tokenizer, store_label=store_label, compare=compare
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        try:
            yield
        finally:
            dash.close()
            if close_store:
                store.close()

    async def on_404(request: Request, exc: Exception) -> Response:
        return _error(404, "no_route", f"no route {request.method} {request.url.path}")

    async def on_405(request: Request, exc: Exception) -> Response:
        return _error(405, "method_not_allowed", f"method {request.method} not allowed on {request.url.path}")

    # every error a JSON body, as everywhere else on agl's servers (static files included)
    app = Starlette(routes=dash.routes(), lifespan=lifespan, exception_handlers={404: on_404, 405: on_405})
    app.state.dashboard = dash
    return app


def mount_redirect(prefix: str) -> Route:
    """``/ui`` -> ``/ui/``: the page's relative links need the trailing slash."""

    def go(request: Request) -> Response:
        return RedirectResponse(prefix + "/", status_code=307)

    return Route(prefix, go, methods=["GET"])
