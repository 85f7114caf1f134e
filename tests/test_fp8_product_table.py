"""The measured choice of block-FP8 product per weight shape and row bucket: the fastest
candidate wins each bucket, a failing candidate is none, rows map to their bucket, the table
round-trips through its cache (so later runs read the same choice instead of re-timing), the
dispatcher obeys an installed table on CUDA only, and a model's FP8 product shapes are found
(the fused q_a + kv_a stack included, the 3-D expert stacks not)."""

import json
from types import SimpleNamespace

import pytest
import torch

from mlaserve.kernels import fp8_product_choice, fp8_product_table
from mlaserve.kernels.fp8_gemm import linear_product_path
from mlaserve.kernels.fp8_product_choice import candidate_paths, choose, load_or_measure
from mlaserve.kernels.fp8_product_table import ProductTable


@pytest.fixture(autouse=True)
def no_table():
    fp8_product_table.uninstall()
    yield
    fp8_product_table.uninstall()


def test_the_fastest_candidate_wins_each_bucket_and_failures_are_no_candidates():
    times = {"a": lambda m: 1.0 + m, "b": lambda m: 2.0 + m / 4, "c": lambda m: None}
    paths = choose([(256, 512), (256, 512), (128, 1024)], lambda m, n, k: ["a", "b", "c"],
                   lambda path, m, n, k: times[path](m), buckets=(1, 2, 4))
    assert paths == {(128, 1024): ((1, "a"), (2, "b"), (4, "b")),
                     (256, 512): ((1, "a"), (2, "b"), (4, "b"))}
    with pytest.raises(RuntimeError, match="no block-FP8 product"):
        choose([(8, 8)], lambda m, n, k: ["c"], lambda path, m, n, k: None, buckets=(1,))


def test_rows_take_their_bucket_and_unknown_shapes_none():
    table = ProductTable("gpu", {(256, 512): ((16, "weight-only"), (64, "deepgemm"),
                                              (8192, "cublas"))})
    assert [table.path(m, 256, 512) for m in (1, 16, 17, 64, 65, 8192, 100000)] == [
        "weight-only", "weight-only", "deepgemm", "deepgemm", "cublas", "cublas", "cublas"]
    assert table.path(4, 256, 1024) is None
    assert ProductTable.from_json(table.to_json()) == table


def test_candidates_follow_what_each_product_takes():
    assert candidate_paths(16, 4096, 2000, sm90=False, deep_gemm=False) == [
        "triton", "weight-only"]  # cuBLASLt wants K a multiple of 512
    assert candidate_paths(128, 4096, 1024, sm90=False, deep_gemm=True) == ["triton", "cublas"]


def test_the_cache_keeps_the_first_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv(fp8_product_choice.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    measured = []

    def measure(shapes, device, unquantized_inputs=()):
        measured.append(shapes)
        return ProductTable("NVIDIA H100", {s: ((8192, f"p{len(measured)}"),) for s in shapes})

    monkeypatch.setattr(fp8_product_choice, "measure", measure)
    first = load_or_measure([(256, 512), (128, 512)], torch.device("cpu"))
    again = load_or_measure([(128, 512), (256, 512)], torch.device("cpu"))
    assert measured == [[(128, 512), (256, 512)]] and again == first
    assert first.path(1, 256, 512) == "p1"
    (cached,) = tmp_path.rglob("*.json")
    cached.write_text("{not json")  # a damaged cache is measured again, not an error
    assert load_or_measure([(128, 512), (256, 512)], torch.device("cpu")).path(1, 128, 512) \
        == "p2"
    assert json.loads(cached.read_text())["device_name"] == "NVIDIA H100"


def test_the_dispatcher_obeys_an_installed_table_on_cuda_only():
    weight = torch.empty(256, 512, dtype=torch.float8_e4m3fn)
    fp8_product_table.install(ProductTable("gpu", {(256, 512): ((8192, "deepgemm"),)}))
    fp8_product_table.install(ProductTable("gpu", {(128, 512): ((8192, "gluon"),)}))  # adds
    cuda_x = SimpleNamespace(is_cuda=True, shape=(3, 512), dtype=torch.bfloat16,
                             device=torch.device("cuda"))
    assert linear_product_path(cuda_x, weight) == "deepgemm"
    assert linear_product_path(cuda_x, torch.empty(128, 512)) == "gluon"
    assert linear_product_path(torch.zeros(3, 512), weight) == "triton"  # the CPU's rule
