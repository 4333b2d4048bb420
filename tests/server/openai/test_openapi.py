"""The published OpenAPI document: one operation id per route."""

from __future__ import annotations

from llmfleet.server.openai.app import create_app


def test_the_openapi_document_has_one_id_per_operation(state):
    """Clients generated from /openapi.json name methods by operation id: none may repeat."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate id
        spec = create_app(state).openapi()
    ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and {"get", "post"} <= set(spec["paths"]["/ping"])
