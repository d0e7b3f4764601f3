"""The stored responses: kept in memory, at most ``--max-stored-responses``, least recently used
dropped first.

``serving.py`` puts a response here when it was created with ``store`` (a background one as
soon as it is queued, then again when it ends), reads it for ``GET``, ``previous_response_id``
and ``cancel``, and deletes it. Each entry holds the response object as served and its
conversation as chat messages (the instructions aside: they do not carry over a chain): the
earlier turns, this request's input and its output; and this request's input as the items
``GET /v1/responses/{id}/input_items`` lists. Creating, reading or chaining from an entry
makes it the most recently used; past the bound the least recently used one is dropped, and a
background response still running when it is dropped is cancelled. A dropped or deleted id is
a 404, as an unknown one.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.server.api.errors import APIError, bad_request
from jaxserve.server.generation import Generation


@dataclasses.dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as GET serves it
    messages: list[dict[str, Any]]  # the conversation so far, chat messages (for chaining)
    generation: Generation | None = None  # a background response's, while it runs
    input_items: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # as listed
    is_cancelled: bool = False


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        param=param,
        code="previous_response_not_found" if param else "response_not_found",
    )


class ResponseStore:
    def __init__(self, max_count: int) -> None:
        self.max_count = max_count
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_count:
            _, dropped = self._entries.popitem(last=False)
            if dropped.generation is not None:
                dropped.generation.cancel(abort=True)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry (now the most recently used); a 404 naming ``param`` if there is none."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> StoredResponse:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            raise not_found(response_id)
        if entry.generation is not None:
            entry.generation.cancel(abort=True)
        return entry


MAX_ITEMS_PAGE = 100  # OpenAI's bound on ``limit``


def input_items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of ``items``, as ``GET /v1/responses/{id}/input_items`` answers: ``order``
    ``desc`` (newest first, the default) or ``asc``, at most ``limit`` items (1 to 100, 20 by
    default) after the item ``after``; a 400 names a bad parameter."""
    unknown = sorted(set(query) - {"order", "limit", "after", "include"})
    if unknown:
        raise bad_request(f"Unrecognized query parameter {unknown[0]}", param=unknown[0])
    if query.get("include"):
        raise bad_request("include is not supported: items are listed as they were sent", "include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc'; got {order!r}", param="order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_ITEMS_PAGE:
        raise bad_request(
            f"limit must be an integer from 1 to {MAX_ITEMS_PAGE}; got {limit_text!r}", "limit"
        )
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise bad_request(f"after: no input item with id {query['after']!r}", param="after")
        start = ids.index(query["after"]) + 1
    data = ordered[start : start + int(limit_text)]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + len(data) < len(ordered),
    }
