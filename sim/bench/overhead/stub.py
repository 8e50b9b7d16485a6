#!/usr/bin/env python3
"""Upstream stub for the overhead benchmark: one Envoy, one listener per fake
model server, every answer a `direct_response`.

Each listener answers like a small OpenAI-compatible server (vLLM-shaped):

  POST */v1/chat/completions, */v1/completions  -> 200, a fixed chat.completion JSON
  GET  /v1/models                               -> the model list (smg reads it)
  GET  /get_model_info, /get_server_info        -> SGLang-style info (smg may read them)
  GET  /health, /health_generate, /ping         -> 200
  GET  /metrics                                 -> a small vLLM /metrics text (kvroute's collector)
  anything else                                 -> 404

A buffer filter reads the whole request body before the direct response, as a
real server does; without it Envoy answers at the headers and then has to drop
the connection to discard the rest of a large body, so connection reuse (and the
benchmark) would depend on the body size. The stub is the same process and the
same config for every arm of the benchmark.

Only the Python standard library is used.

    python3 stub.py --ports 27101,27102 --admin-port 27100 > stub.yaml
"""

import argparse
import json
import sys

MODEL = "bench-model"

# ~300 bytes, the shape of a non-streaming vLLM chat completion.
CHAT_RESPONSE = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 2048, "completion_tokens": 1, "total_tokens": 2049},
    },
    separators=(",", ":"),
)

MODELS_RESPONSE = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": MODEL,
                "object": "model",
                "created": 1700000000,
                "owned_by": "vllm",
                "root": MODEL,
                "max_model_len": 1048576,
            }
        ],
    },
    separators=(",", ":"),
)

MODEL_INFO_RESPONSE = json.dumps(
    {
        "model_path": MODEL,
        "tokenizer_path": MODEL,
        "is_generation": True,
        "served_model_name": MODEL,
        "max_total_num_tokens": 1048576,
    },
    separators=(",", ":"),
)

SERVER_INFO_RESPONSE = json.dumps(
    {"model_path": MODEL, "served_model_name": MODEL, "max_total_num_tokens": 1048576, "version": "stub"},
    separators=(",", ":"),
)

# The few vLLM series kvroute's collector reads; values of an idle server.
METRICS_RESPONSE = (
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.01\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="65536"} 1.0\n'
    "# TYPE vllm:prefix_cache_queries_total counter\n"
    f'vllm:prefix_cache_queries_total{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:prefix_cache_hits_total counter\n"
    f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} 0.0\n'
)


def _route(match, status, body, content_type="application/json"):
    return {
        "match": match,
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {"header": {"key": "content-type", "value": content_type}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        ],
    }


def _listener(index, port, buffer_limit, access_log=None):
    routes = [
        _route({"safe_regex": {"regex": ".*/v1/(chat/)?completions"}}, 200, CHAT_RESPONSE),
        # Anthropic's Messages API (the benchmark's -msgs bodies): the same
        # answer; the body does not matter to the proxies.
        _route({"safe_regex": {"regex": ".*/v1/messages"}}, 200, CHAT_RESPONSE),
        _route({"path": "/v1/models"}, 200, MODELS_RESPONSE),
        _route({"path": "/get_model_info"}, 200, MODEL_INFO_RESPONSE),
        _route({"path": "/get_server_info"}, 200, SERVER_INFO_RESPONSE),
        _route({"path": "/server_info"}, 200, SERVER_INFO_RESPONSE),
        _route({"path": "/health"}, 200, "", "text/plain"),
        _route({"path": "/health_generate"}, 200, "", "text/plain"),
        _route({"path": "/ping"}, 200, "", "text/plain"),
        _route({"path": "/metrics"}, 200, METRICS_RESPONSE, "text/plain; version=0.0.4"),
        _route({"prefix": "/"}, 404, '{"error":{"message":"not found","type":"NotFoundError"}}'),
    ]
    return {
        "name": f"stub{index}",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "per_connection_buffer_limit_bytes": buffer_limit,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            # http.stub<N>.downstream_rq_* counts what each fake server got.
                            "stat_prefix": f"stub{index}",
                            "access_log": _access_log(access_log),
                            "route_config": {
                                "name": f"stub{index}",
                                "max_direct_response_body_size_bytes": 65536,
                                "virtual_hosts": [{"name": "stub", "domains": ["*"], "routes": routes}],
                            },
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.buffer",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                                        "max_request_bytes": buffer_limit,
                                    },
                                },
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                    },
                                },
                            ],
                        },
                    }
                ]
            }
        ],
    }


def _access_log(path):
    """Optional: log method, path and status of every request (to see what a
    router probes). Off in measured runs."""
    if not path:
        return []
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": path,
                "log_format": {
                    "text_format_source": {
                        "inline_string": "%DOWNSTREAM_LOCAL_ADDRESS% %REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% %BYTES_RECEIVED%\n"
                    }
                },
            },
        }
    ]


def render(ports, admin_port, buffer_limit=8 * 1024 * 1024, access_log=None):
    """The stub bootstrap as JSON text (Envoy reads a .json bootstrap as is)."""
    doc = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [_listener(i, p, buffer_limit, access_log) for i, p in enumerate(ports)]
        },
    }
    return json.dumps(doc, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ports", required=True, help="comma-separated listener ports, one per fake server")
    p.add_argument("--admin-port", type=int, required=True)
    p.add_argument("--access-log", help="log every request's method, path and status to this file")
    args = p.parse_args(argv)
    sys.stdout.write(render([int(x) for x in args.ports.split(",")], args.admin_port, access_log=args.access_log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
