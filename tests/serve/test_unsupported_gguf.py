"""A served GGUF model whose linear tensors mtplm cannot run as they are (`dtype = "gguf"`, a block type
without a kernel) is the request's to fix, not a server fault: a 400 naming the tensor and the types that
run, not a 500."""

from __future__ import annotations

import httpx
from serving import LiveServer

from mtplm.assets import quantized
from test_gguf_quantized import write_tiny_gguf


def test_an_unsupported_gguf_tensor_type_is_a_400_naming_it(tmp_path):
    directory = write_tiny_gguf(tmp_path / "odd", hidden=256, odd="blk.1.ffn_up.weight")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "models.toml").write_text(f'[[model]]\nid = "odd"\npath = "{directory}"\ndtype = "gguf"\n')
    request = {"model": "odd", "prompt": "t1 t2", "max_tokens": 2, "temperature": 0}
    with LiveServer(repo, api_key=None) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        response = http.post("/v1/completions", json=request)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_model" and error["type"] == "invalid_request_error"
        assert "blk.1.ffn_up.weight is Q2_K" in error["message"] and "\n" not in error["message"]
        assert all(kind in error["message"] for kind in quantized.SUPPORTED)
