"""A small real OpenAI-compatible server for tests: `/v1/completions` answered by HF greedy generation.

    with CompletionsServer(model, tokenizer, stop_token_ids) as server:   # server.url = http://127.0.0.1:PORT
        ...

GET /v1/models lists `served_name`, GET /version reports `version`; POST /v1/completions takes a prompt as token
ids or text (tokenised without special tokens), answers with the decoded text, finish_reason "stop" / "length"
and usage.completion_tokens (incl. the stop token). `die_after=N`: after N completions the server shuts down
(the N+1-th request's connection is dropped, later ones are refused), like a server that crashed.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from data.engines import HFEngine, Sampling


class CompletionsServer:
    def __init__(self, model, tokenizer, stop_token_ids, served_name="stories260K", version="test-0",
                 die_after: int | None = None):
        self.model, self.tokenizer, self.stop_token_ids = model, tokenizer, tuple(stop_token_ids)
        self.served_name, self.version, self.die_after = served_name, version, die_after
        self.completions, self.lock = 0, threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()

    def complete(self, body: dict) -> tuple[int, dict]:
        if body.get("model") != self.served_name:
            return 404, {"error": {"message": f"model {body.get('model')!r} not found"}}
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        sampling = Sampling(int(body["max_tokens"]), self.stop_token_ids)
        pad_id = self.stop_token_ids[0]
        with self.lock:  # one generation at a time (one model)
            (answer,) = HFEngine(self.model, sampling, pad_id, 1).generate([prompt])
        content = answer.tokens[:-1] if answer.finished else answer.tokens
        text = self.tokenizer.decode(content, skip_special_tokens=True)
        return 200, {"id": "cmpl-test", "object": "text_completion", "model": self.served_name,
                     "choices": [{"index": 0, "text": text, "finish_reason": "stop" if answer.finished else "length"}],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(answer.tokens)}}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.served_name, "object": "model"}]})
                elif self.path == "/version":
                    self._send(200, {"version": server.version})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self._send(404, {"error": "not found"})
                with server.lock:
                    dying = server.die_after is not None and server.completions >= server.die_after
                    server.completions += not dying
                if dying:  # crash: drop this connection, stop listening
                    self.close_connection = True
                    threading.Thread(target=server.stop, daemon=True).start()
                    return None
                self._send(*server.complete(body))

        return Handler
