"""`mtplm serve` as a real process: graceful shutdown, and several replicas behind nginx on loopback."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from serving import LiveServer, free_port, write_manifest

pytestmark = pytest.mark.process  # every test here launches processes


def _start(repo: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mtplm.cli",
            "serve",
            "--repository",
            str(repo),
            "--port",
            str(port),
            "--dtype",
            "fp32",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not start: {process.stdout.read()}")


def test_sigterm_drains_then_fails_in_flight_requests_cleanly(base_dir, tmp_path):
    repo = write_manifest(tmp_path / "repo", {"base": (base_dir, None)})
    port = free_port()
    process = _start(repo, port, "--shutdown-grace", "0.1")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
    )
    try:
        short = client.completions.create(model="base", prompt="t1 t2", max_tokens=3, temperature=0)
        assert short.choices[0].finish_reason == "length"
        stream = client.completions.create(
            model="base",
            prompt="t1 t2",
            max_tokens=505,
            temperature=0,
            stream=True,
            extra_body={"mode": "ntp", "ignore_eos": True},
        )
        received = [next(iter(stream))]
        process.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shut down"):  # an error event, not a torn connection
            for chunk in stream:
                received.append(chunk)
        assert len(received) < 505
        assert process.wait(timeout=30) == 0  # drained, failed cleanly, exited normally
    finally:
        if process.poll() is None:
            process.kill()
    log = process.stdout.read()
    assert "Traceback" not in log
    # the drain says what it waits for, for how long, and what became of it
    assert "waiting up to 0.1 s for 1 in-flight request to finish" in log, log
    assert "1 request still running after" in log and "ending it with a shutdown error" in log, log


NGINX_CONF = """
worker_processes 1;
error_log {dir}/error.log;
pid {dir}/nginx.pid;
daemon off;
events {{ worker_connections 64; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream mtplm {{
        least_conn;
        {servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://mtplm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def test_replicas_behind_nginx_share_the_load(chain_checkpoint, tmp_path):
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run installs it)")
    repo = write_manifest(tmp_path / "repo", {"chain": (chain_checkpoint, "confadapt:0.6@4")})
    with LiveServer(repo, api_key=None) as first, LiveServer(repo, api_key=None) as second:
        port = free_port()
        conf = tmp_path / "nginx.conf"
        servers = "\n        ".join(f"server 127.0.0.1:{s.port};" for s in (first, second))
        conf.write_text(NGINX_CONF.format(dir=tmp_path, servers=servers, port=port))
        proxy = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp_path)], stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except httpx.HTTPError:
                    time.sleep(0.1)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

            def ask(i: int) -> str:
                stream = client.completions.create(
                    model="chain", prompt=f"t{i} t{i + 1}", max_tokens=20, temperature=0, stream=True
                )
                return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(ask, range(8)))
            direct = openai.OpenAI(base_url=f"{first.url}/v1", api_key="unused", max_retries=0)
            expected = [
                direct.completions.create(
                    model="chain", prompt=f"t{i} t{i + 1}", max_tokens=20, temperature=0
                )
                .choices[0]
                .text
                for i in range(8)
            ]
        finally:
            proxy.terminate()
            proxy.wait(timeout=10)
        assert answers == expected
        through_first = _requests(first.url) - 8  # less the direct requests
        through_second = _requests(second.url)
        assert through_first >= 1 and through_second >= 1 and through_first + through_second == 8


def _requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("mtplm_requests_total")
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--repository", "/nonexistent/models"], "does not exist"),
        (["--model", "a=x", "--model", "a=y"], "unique"),
        (["--default-mode", "turbo"], "bad decoding mode"),
        (["--k-by-batch", "8-1"], "bad --k-by-batch"),
        (
            ["--model", "no-such-model"],
            "'no-such-model' is not a checkpoint",
        ),  # used to start, then 500 every request
    ],
)
def test_bad_serve_arguments_are_one_clear_line(args, needle, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mtplm.cli", "serve", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_port_in_use_is_one_line_before_serving(base_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "mtplm.cli", "serve", "--model", str(base_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "another process" in result.stderr
    assert "serving" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_manifest_with_unknown_keys_is_refused(tmp_path):
    (tmp_path / "models.toml").write_text('[[model]]\nid = "a"\npath = "x"\nmdoe = "ntp"\n')
    result = subprocess.run(
        [sys.executable, "-m", "mtplm.cli", "serve", "--repository", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "unknown: mdoe" in result.stderr


def test_without_the_serve_extra_the_error_names_it():
    code = (
        "import sys; sys.modules['fastapi'] = None\n"  # as if the extra were not installed
        "from mtplm.cli import main; sys.exit(main(['serve']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "mtplm[serve]" in result.stderr and "fastapi" in result.stderr
