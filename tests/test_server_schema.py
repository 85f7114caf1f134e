"""Property-based requests generated from the app's published OpenAPI schema (schemathesis):
no 5xx, and every response conforms to the schema (status code, content type, body)."""

import pytest

schemathesis = pytest.importorskip("schemathesis")  # test-only; absent on a bare GPU machine
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_util import RunningServer  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def test_generated_requests_get_no_server_error_and_match_the_schema():
    with RunningServer(max_model_len=48, num_kv_blocks=64) as running:
        schema = schemathesis.openapi.from_url(running.url + "/openapi.json")
        checked = []
        for result in schema.get_all_operations():
            operation = result.ok()
            examples = 15 if operation.method.upper() == "POST" else 5

            @given(case=operation.as_strategy())
            @settings(max_examples=examples, deadline=None,
                      suppress_health_check=list(HealthCheck), derandomize=True,
                      database=None)
            def check(case):
                case.call_and_validate(checks=CHECKS, timeout=60)

            check()
            checked.append(operation.path)
        assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(checked)
