"""Rollout dispatch benchmark: one engine's requests one at a time (the dispatcher before issue 42) against all of
them in flight (rollout.max_inflight_requests), through the real SGLang HTTP client path.

The engine is a fake SGLang server that SGLangEngine starts itself (its `subprocess` mode: API key file, /health
wait, /generate with per-row `sampling_seed`, the answers parsed by parse_generate_output). It decodes like a
server that batches continuously with KV room for every request: each row's response length comes from its seed
(long-tailed: Pareto, most rows short, a few at the budget) and costs `--token-ms` per token; a request answers
when its longest row is done, and requests in flight decode side by side. So a serial dispatcher pays the sum of
the requests' slowest rows, a concurrent one about the slowest of them: the scheduling gap, not a GPU's speed.

Prints each bound's wall time, its speed-up over one in flight, and whether every bound produced the same rows.

usage: python benchmarks/bench_rollout_dispatch.py [--requests 32] [--rows 8] [--token-ms 5.0] [--max-tokens 512]
                                                   [--inflight 1,4,32]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import time
from pathlib import Path

FAKE_SERVER = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, key_file, token_s, max_tokens = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    api_key = json.loads(open(key_file).read().strip()[len("api-key: "):])

    def length(seed):  # long-tailed response lengths from the row's seed: Pareto(alpha 1.2), 8 tokens minimum
        u = ((seed * 2654435761) % 2**32 + 0.5) / 2**32
        return min(max_tokens, int(8 / u ** (1 / 1.2)))

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send({})

        def do_POST(self):
            if self.headers.get("Authorization") != "Bearer " + api_key:
                self.send_response(401)
                self.end_headers()
                return
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            lengths = [length(p["sampling_seed"]) for p in payload["sampling_params"]]
            time.sleep(max(lengths) * token_s)  # the batch decodes until its longest row is done
            self._send([{"meta_info": {
                "output_token_logprobs": [[-0.01 * (k % 7), (p["sampling_seed"] + k) % 1000, None] for k in range(n)],
                "finish_reason": {"type": "length" if n == max_tokens else "stop"}}}
                for n, p in zip(lengths, payload["sampling_params"])])

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32, help="requests of one engine in a step")
    p.add_argument("--rows", type=int, default=8, help="rows per request (request_prompts x n)")
    p.add_argument("--token-ms", type=float, default=5.0, help="decode time per token of a batch")
    p.add_argument("--max-tokens", type=int, default=512, help="the response budget (rollout.max_new_tokens)")
    p.add_argument("--inflight", default="1,4,32", help="rollout.max_inflight_requests values to time")
    args = p.parse_args(argv)

    from megatron_qarl.rollout.dispatch import generate_concurrently, plan_requests
    from megatron_qarl.rollout.protocol import SamplingParams
    from megatron_qarl.rollout.sglang_client import SGLangEngine
    from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig

    bounds = [int(b) for b in args.inflight.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "fake_sglang.py"
        script.write_text(FAKE_SERVER)
        engine = SGLangEngine(SGLangEngineConfig(
            mode="subprocess", health_timeout_s=60, request_timeout_s=600, model_type="qwen3_moe",
            launch_cmd=[sys.executable, str(script), "{port}", "{key_file}", str(args.token_ms / 1000),
                        str(args.max_tokens)],
            log_path=str(Path(tmp) / "server.log")))
        try:
            n = 1
            rows = [[1 + r, 2, 3] for r in range(args.requests * args.rows)]
            requests = plan_requests(len(rows), n, args.rows, engines=1)
            sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens, seed=7)
            print(f"one engine, {args.requests} requests x {args.rows} rows, {args.token_ms} ms/token, response "
                  f"budget {args.max_tokens} tokens (Pareto lengths), SGLang HTTP client against a fake server")
            first, reference = None, None
            for bound in bounds:
                t0 = time.perf_counter()
                got = [(req.index, [(r.token_ids, r.logprobs) for r in res])
                       for req, res, _ in generate_concurrently(engine, rows, sampling, requests, retries=0,
                                                                max_inflight=bound)]
                wall = time.perf_counter() - t0
                first = first or wall
                reference = reference or got
                print(f"  max_inflight_requests={bound:>4}: {wall:7.2f} s   x{first / wall:5.1f} vs 1 in flight   "
                      f"rows identical to the first: {got == reference}")
        finally:
            engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
