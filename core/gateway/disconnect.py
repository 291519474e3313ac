"""A client that goes away: the generation it asked for is cancelled and its call recorded as an ERROR.

The gateway runs each generation as a task and watches the request's receive channel beside it; an
``http.disconnect`` cancels the task (so the engine stops spending compute on a reply nobody reads)
and marks the call gone, which the routes turn into :class:`ClientGone` and an ERROR span.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

__all__ = ["ClientGone", "cancel_on_disconnect"]


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


async def cancel_on_disconnect(request: Request, task: Any, gone: list[bool]) -> None:
    """Cancel ``task`` and append to ``gone`` when the client disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
            task.cancel()
            return
