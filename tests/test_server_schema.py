"""Property-based requests generated from the app's OpenAPI schema never get a 5xx."""

import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server_util import RunningServer


def test_generated_requests_never_get_a_server_error():
    with RunningServer(max_model_len=48, num_kv_blocks=64) as running:
        schema = schemathesis.openapi.from_url(running.url + "/openapi.json")
        checked = []
        for result in schema.get_all_operations():
            operation = result.ok()

            @given(case=operation.as_strategy())
            @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True,
                      database=None)
            def check(case):
                response = case.call(timeout=60)
                assert response.status_code < 500, (case.path, case.body, response.text[:300])

            check()
            checked.append(operation.path)
        assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(checked)
