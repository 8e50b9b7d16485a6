#!/usr/bin/env python3
"""Render an Envoy 1.40 bootstrap that runs kvroute in front of vLLM endpoints.

The output is plain YAML meant to be read and copied. One source of truth for
the local run script (envoy/run.sh), the end-to-end tests (tests/e2e) and the
demo (scripts/demo.sh): they all call this file, so what the tests exercise is
what a user gets.

    python3 envoy/render.py --endpoints 127.0.0.1:18001,127.0.0.1:18002 > kvroute.yaml
    python3 envoy/render.py --eds-file /etc/kvroute/vllm-eds.json > kvroute.yaml

Only the Python standard library is used.
"""

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WASM = os.path.join(REPO, "target", "wasm32-wasip1", "release", "kvroute_wasm.wasm")
DEFAULT_PLUGIN_CONFIG = os.path.join(REPO, "envoy", "kvroute-config.json")

# The model-server cluster. The filter names hosts of this cluster in the
# destination header.
VLLM_CLUSTER = "vllm"
# The collector polls each endpoint's /metrics through this ORIGINAL_DST
# cluster, naming the endpoint's ip:port in ORIGINAL_DST_HOST_HEADER: the call
# reaches that address or fails. (Through the vllm cluster, a slot that is no
# longer a healthy member would be answered by the fallback round robin's
# pick, another server's counters recorded under it.) No route points at it.
METRICS_CLUSTER = "kvroute_metrics"
ORIGINAL_DST_HOST_HEADER = "x-envoy-original-dst-host"
# A STATIC cluster pointing at Envoy's own admin listener, so the collector can
# read /clusters?format=json (membership + health of the vllm cluster).
ADMIN_CLUSTER = "envoy_admin"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# kvEvents: the collector calls each endpoint's KV-event relay (relay/) through
# this ORIGINAL_DST cluster, naming the relay's ip:port in RELAY_HOST_HEADER.
# No route points at it, so clients cannot reach it.
RELAY_CLUSTER = "kvroute_relays"
RELAY_HOST_HEADER = ORIGINAL_DST_HOST_HEADER
# Where --state-listener serves the shared state (routing.statePath there).
DEFAULT_STATE_PATH = "/kvroute/state"

# Envoy's default per-connection buffer limit is 1 MiB. The filter buffers a
# whole request body (up to routing.maxBodyBytes, 4 MiB by default) before it
# decides, so both the listener and the cluster get 8 MiB.
DEFAULT_BUFFER_LIMIT_BYTES = 8 * 1024 * 1024


def parse_hostport(text):
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint {text!r} is not ip:port (for example 127.0.0.1:8000)")
    return host.strip("[]"), int(port)


def plugin_config_for(config, endpoints, eds_file, refresh_ms):
    """Fill the plugin config's `endpoints` section so it matches the cluster.

    A config that already has an `endpoints` section is left alone: the user
    said what they want.
    """
    config = json.loads(json.dumps(config))
    if "endpoints" not in config:
        if eds_file:
            config["endpoints"] = {
                "fromCluster": {"cluster": VLLM_CLUSTER, "adminCluster": ADMIN_CLUSTER, "refreshMs": refresh_ms}
            }
        else:
            config["endpoints"] = {"static": list(endpoints)}
    return config


def _indent(text, spaces):
    pad = " " * spaces
    return "\n".join(pad + line if line else line for line in text.splitlines())


def _readable_json(config):
    """JSON with one top-level key per line and one list item per line."""

    def flat(value):
        return json.dumps(value, separators=(", ", ": "))

    lines = []
    items = list(config.items())
    for i, (key, value) in enumerate(items):
        comma = "," if i + 1 < len(items) else ""
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            inner = ",\n".join("    " + flat(v) for v in value)
            lines.append(f"  {json.dumps(key)}: [\n{inner}\n  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {flat(value)}{comma}")
    return "{\n" + "\n".join(lines) + "\n}"


def _plugin_configuration_yaml(config, indent):
    """The plugin JSON as a google.protobuf.StringValue, JSON kept readable."""
    body = _readable_json(config)
    pad = " " * indent
    return (
        f'{pad}configuration:\n'
        f'{pad}  "@type": type.googleapis.com/google.protobuf.StringValue\n'
        f'{pad}  value: |\n'
        f'{_indent(body, indent + 4)}\n'
    )


def _vm_config_yaml(wasm, indent):
    pad = " " * indent
    return (
        f"{pad}vm_config:\n"
        f"{pad}  vm_id: kvroute            # same vm_id for both roles => same shared data\n"
        f"{pad}  runtime: envoy.wasm.runtime.v8\n"
        f"{pad}  code:\n"
        f"{pad}    local:\n"
        f"{pad}      filename: {wasm}\n"
    )


def state_plugin_config(config, state_path=DEFAULT_STATE_PATH):
    """The plugin config of the internal state listener's filter: the same
    config with routing.statePath set, and no debug header (nothing is routed
    there)."""
    config = json.loads(json.dumps(config))
    routing = config.setdefault("routing", {})
    routing["statePath"] = state_path
    routing.pop("debugHeader", None)
    return config


def _wasm_filter_yaml(name, wasm, config):
    """The HTTP filter entry of the routing filter (12 spaces deep, in
    http_filters)."""
    return f"""          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: kvroute
                # Lets the filter pause at request headers and still receive the
                # body (Envoy >= 1.35). Without it the request hangs.
                allow_on_headers_stop_iteration: true
                # If a VM ever dies, rebuild it (1 s backoff) instead of
                # answering 503 on that worker forever (FAIL_CLOSED).
                failure_policy: FAIL_RELOAD
{_vm_config_yaml(wasm, 16)}{_plugin_configuration_yaml(config, 16)}
"""


def _state_listener_yaml(host, port, wasm, config, state_path):
    """A second listener, for operators only: the same module and vm_id (so
    the same shared data) with routing.statePath set. It has no route to the
    model servers; every path but the state path gets a 404 from Envoy, with
    the filter switched off for it."""
    return f"""
  # Internal listener: GET {state_path} answers the shared state (endpoints,
  # in-flight load, metrics). Bind it where only operators reach it. It has no
  # route to the model servers, and the client listener serves no state.
  - name: kvroute_state
    address:
      socket_address: {{address: {host}, port_value: {port}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: kvroute_state
          route_config:
            name: kvroute_state
            virtual_hosts:
            - name: state
              domains: ["*"]
              routes:
              # The filter answers GET {state_path} itself, before this route.
              - match: {{path: "{state_path}"}}
                direct_response: {{status: 404}}
              - match: {{prefix: "/"}}
                direct_response:
                  status: 404
                  body: {{inline_string: "this listener serves only GET {state_path}"}}
                typed_per_filter_config:
                  envoy.filters.http.wasm:
                    "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
                    disabled: true
          http_filters:
{_wasm_filter_yaml("kvroute-state", wasm, config)}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""


# Envoy stats of the module (docs/observability.md). The slot of a
# per-endpoint gauge (`wasmcustom.kvroute_endpoint_*.slot.<n>`) becomes the
# Prometheus label `slot`; the regex is kvroute_core::lifecycle::telemetry's
# SLOT_TAG_REGEX; a flow-control stat's band (`wasmcustom.kvroute_flow_*.band.<p>`,
# `m5` for priority -5) becomes `band` (kvroute_core::flow::BAND_TAG_REGEX). Histogram buckets fit each stat's unit (Envoy's default
# buckets are for milliseconds).
STATS_CONFIG_YAML = r"""
# kvroute's stats: the endpoint slot as a Prometheus label, and buckets that
# fit the histograms' units (µs; percent).
stats_config:
  stats_tags:
  - tag_name: slot
    regex: '^wasmcustom\.kvroute_endpoint_[a-z_]+(\.slot\.([0-9]+))$'
  - tag_name: band
    regex: '^wasmcustom\.kvroute_flow_[a-z_]+(\.band\.(m?[0-9]+))$'
  histogram_bucket_settings:
  - match: {prefix: wasmcustom.kvroute_decision_time_us}
    buckets: [10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 100000]
  - match: {prefix: wasmcustom.kvroute_affinity_percent}
    buckets: [0.5, 10, 25, 50, 75, 90, 95, 99, 100]
  - match: {prefix: wasmcustom.kvroute_flow_wait_ms}
    buckets: [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000]
"""


def debug_plugin_config(config):
    """The plugin config of the internal debug listener's filter: the same
    config with routing.debugHeader on (and no state path)."""
    config = json.loads(json.dumps(config))
    routing = config.setdefault("routing", {})
    routing["debugHeader"] = True
    routing.pop("statePath", None)
    return config


def _debug_listener_yaml(host, port, wasm, config, buffer_limit):
    """A third listener, for operators only: routes like the client listener,
    with the same module and vm_id (so the same shared data and the same
    charges), and adds the decision explanation (x-kvroute-decision) to each
    routed response."""
    return """
  # Internal listener: routed like the client listener, and every routed
  # response carries x-kvroute-decision (why this endpoint). Bind it where
  # only operators reach it; the client listener adds no such header.""" + _routing_listener_yaml(
        "kvroute_debug", host, port, buffer_limit, _wasm_filter_yaml("kvroute-debug", wasm, config)
    )


# The first HTTP filter of every listener that reaches the model servers'
# cluster: drops a client's destination header on every route, before
# kvroute runs. The cluster's override_host policy honours the header on any
# route that reaches it, and Envoy applies a route's or virtual host's
# request_headers_to_remove when the router forwards, after kvroute has set
# the header: there it would remove kvroute's own pick too (checked on 1.40).
STRIP_DESTINATION_FILTER_YAML = f"""          # A client's {DESTINATION_HEADER} never reaches the load balancer: it
          # is dropped here, on every route, before kvroute sets its own.
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - remove: {DESTINATION_HEADER}
"""


def _routing_listener_yaml(name, address, port, buffer_limit, filters):
    """A listener that routes every path to the model servers' cluster
    through `filters` (YAML of the HTTP filters before the router), after
    the filter that drops a client's destination header."""
    return f"""
  - name: {name}
    address:
      socket_address: {{address: {address}, port_value: {port}}}
    per_connection_buffer_limit_bytes: {buffer_limit}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          # A front gateway: the peer's address is the client's (appended to
          # x-forwarded-for), and no client is trusted with x-envoy-* request
          # headers (x-envoy-retry-on, x-envoy-max-retries, ...): with
          # internal_address_config unset, Envoy >= 1.33 treats no address as
          # internal, so it strips them whatever x-forwarded-for says. Do not
          # add an empty internal_address_config {{}}: on 1.40 that trusts a
          # loopback peer again (checked; Envoy's old default, RFC1918 too).
          use_remote_address: true
          route_config:
            name: {name}
            virtual_hosts:
            - name: models
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: {VLLM_CLUSTER}
                  # Generations stream for minutes: no overall deadline. The
                  # connection manager's stream_idle_timeout (5 min) still applies.
                  timeout: 0s
                  # Retry only when the request never reached a model server,
                  # so a prompt is never run twice. A retry takes the next
                  # address of the destination header, then round robin.
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset-before-request
                    num_retries: 1
          http_filters:
{STRIP_DESTINATION_FILTER_YAML}{filters}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"""


def _vllm_cluster_yaml(endpoints, eds_file, buffer_limit):
    override_host = f"""    # The filter picks the host: it writes "{DESTINATION_HEADER}: ip:port[,fallback...]".
    # Addresses that are not members of this cluster are skipped; with no usable
    # address left, the fallback policy (round robin) picks. A client can never
    # reach a non-member this way, and a client's copy of the header is dropped
    # on every route (the listeners' first filter).
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: {DESTINATION_HEADER}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
"""
    head = f"""  - name: {VLLM_CLUSTER}
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {buffer_limit}
    # LLM traffic: many long-lived concurrent streams per model server.
    circuit_breakers:
      thresholds:
      - max_connections: 4096
        max_pending_requests: 4096
        max_requests: 4096
    # vLLM's server (uvicorn) closes an idle keep-alive connection after 5 s
    # (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); Envoy keeps idle upstream connections
    # for an hour by default. A request sent on a connection the server is
    # closing gets "503 upstream connect error ... connection termination".
    # Envoy closes its side first.
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        common_http_protocol_options:
          idle_timeout: 4s
        explicit_http_config:
          http_protocol_options: {{}}
"""
    if eds_file:
        eds_dir = os.path.dirname(os.path.abspath(eds_file))
        membership = f"""    # Membership from an EDS file; replace it atomically (write + rename) to
    # add or remove model servers. The collector follows it through the admin API.
    type: EDS
    eds_cluster_config:
      eds_config:
        resource_api_version: V3
        path_config_source:
          path: {os.path.abspath(eds_file)}
          watched_directory:
            path: {eds_dir}
"""
    else:
        lb = "".join(
            f"        - endpoint: {{address: {{socket_address: {{address: {h}, port_value: {p}}}}}}}\n"
            for h, p in (parse_hostport(e) for e in endpoints)
        )
        membership = f"""    type: STATIC
    load_assignment:
      cluster_name: {VLLM_CLUSTER}
      endpoints:
      - lb_endpoints:
{lb}"""
    return head + membership + override_host


def metrics_cluster_yaml(name=METRICS_CLUSTER):
    """The cluster the collector polls each endpoint's /metrics through."""
    return f"""  # The collector's /metrics polls: the endpoint's ip:port comes from the
  # {ORIGINAL_DST_HOST_HEADER} header the collector sets, so an answer comes
  # from the endpoint it is recorded for, or the poll fails. No route uses
  # this cluster, so a client cannot reach it.
  - name: {name}
    connect_timeout: 1s
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: {ORIGINAL_DST_HOST_HEADER}
    # As on {VLLM_CLUSTER}: vLLM closes an idle keep-alive connection after
    # 5 s; Envoy closes its side first, so a poll never lands on a closing one.
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        common_http_protocol_options:
          idle_timeout: 4s
        explicit_http_config:
          http_protocol_options: {{}}
"""


def relay_cluster_yaml(name=RELAY_CLUSTER):
    """The cluster the collector reaches KV-event relays through (kvEvents)."""
    return f"""  # kvEvents: the collector's calls to each endpoint's KV-event relay. The
  # relay's ip:port comes from the {RELAY_HOST_HEADER} header the collector
  # sets; no route uses this cluster, so a client cannot reach it.
  - name: {name}
    connect_timeout: 1s
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: {RELAY_HOST_HEADER}
"""


def tokenizer_clusters_yaml(config):
    """A cluster for each token-producer's `tokenizerUrl` (the collector
    fetches tokenizer.json through `tokenizerCluster`): STATIC for an IP
    address, STRICT_DNS for a host name; port 80 unless the URL names one."""
    out = ""
    seen = set()
    for p in config.get("plugins", []):
        params = p.get("parameters") or {}
        url, name = params.get("tokenizerUrl"), params.get("tokenizerCluster")
        if p.get("type") not in ("token-producer", "tokenizer") or not url or not name or name in seen:
            continue
        seen.add(name)
        m = re.fullmatch(r"http://([^/:]+)(?::(\d+))?(/.*)?", url)
        if not m:
            raise ValueError(f"tokenizerUrl {url!r} must be http://host[:port]/path")
        host, port = m.group(1), int(m.group(2) or 80)
        kind = "STATIC" if re.fullmatch(r"[0-9.]+", host) else "STRICT_DNS"
        out += f"""  # The collector fetches the tokenizer of model {params.get("modelName", "")} from here
  # (tokenizerUrl, pinned by tokenizerSha256). No route uses this cluster.
  - name: {name}
    connect_timeout: 2s
    type: {kind}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}
"""
    return out


def render(
    *,
    listen_address="127.0.0.1",
    listen_port=10000,
    admin_port=9901,
    endpoints=(),
    eds_file=None,
    plugin_config=None,
    wasm=DEFAULT_WASM,
    buffer_limit=DEFAULT_BUFFER_LIMIT_BYTES,
    refresh_ms=500,
    baseline=False,
    state_listener=None,
    state_path=DEFAULT_STATE_PATH,
    debug_listener=None,
):
    """Return the bootstrap YAML as a string.

    state_listener="ip:port" adds an internal listener that serves the shared
    state at state_path (GET), for operators; the client listener then keeps
    whatever the plugin config says (the shipped config serves no state).

    debug_listener="ip:port" adds an internal listener that routes like the
    client listener and adds the decision header (routing.debugHeader) there
    only.

    baseline=True renders the same listener and cluster without kvroute (no
    wasm anywhere): the cluster's fallback round robin picks every host. It
    is the side-by-side reference for the demo and for overhead benchmarks.
    """
    if not endpoints and not eds_file:
        raise ValueError("give --endpoints ip:port,... or --eds-file PATH")
    if endpoints and eds_file:
        raise ValueError("give either --endpoints or --eds-file, not both")
    if baseline and debug_listener:
        raise ValueError("--debug-listener needs kvroute; it makes no sense with --baseline")
    if baseline and state_listener:
        raise ValueError("--state-listener needs kvroute; it makes no sense with --baseline")
    if not re.fullmatch(r"/[A-Za-z0-9/._~-]*", state_path):
        raise ValueError(f"--state-path {state_path!r} must start with / and hold only letters, digits and /._~-")
    if plugin_config is None:
        with open(DEFAULT_PLUGIN_CONFIG) as f:
            plugin_config = json.load(f)
    config = plugin_config_for(plugin_config, endpoints, eds_file, refresh_ms)
    wasm = os.path.abspath(wasm)

    collector = f"""
# Role 2 of the module: the collector, one VM on the main thread. It discovers
# endpoints, polls their /metrics and reaps orphaned in-flight charges.
bootstrap_extensions:
- name: envoy.bootstrap.wasm
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.wasm.v3.WasmService
    singleton: true
    config:
      name: kvroute-collector
      root_id: kvroute-collector
      # The filter's policy. Envoy 1.40 accepts it here, but reloads a failed
      # VM only when a stream asks the plugin for a context, which a bootstrap
      # service never does: a dead collector stays dead until Envoy restarts.
      # The filter's workers publish kvroute_collector_tick_age_ms, which then
      # grows (docs/operations.md, runbook).
      failure_policy: FAIL_RELOAD
{_vm_config_yaml(wasm, 6)}{_plugin_configuration_yaml(config, 6)}"""
    if config.get("collector", {}).get("mode") == "lease":
        # collector.mode lease: a filter-only install. The HTTP filter's
        # worker VMs elect the collector among themselves (a lease key in
        # shared data), so there is no singleton to add.
        collector = "\n# collector.mode lease: no singleton; the worker VMs elect the collector.\n"
    routing_filter = "          # Role 1 of the module: the HTTP filter, one VM per worker thread.\n" + _wasm_filter_yaml(
        "kvroute", wasm, config
    )
    state = ""
    if state_listener:
        host, port = parse_hostport(state_listener)
        state = _state_listener_yaml(host, port, wasm, state_plugin_config(config, state_path), state_path)
    if debug_listener:
        host, port = parse_hostport(debug_listener)
        state += _debug_listener_yaml(host, port, wasm, debug_plugin_config(config), buffer_limit)
    stats_config = STATS_CONFIG_YAML
    title = "Envoy 1.40 bootstrap for kvroute"
    kv_events = config.get("kvEvents") or {}
    relays = relay_cluster_yaml(kv_events.get("cluster", RELAY_CLUSTER)) if kv_events.get("enabled") else ""
    relays += tokenizer_clusters_yaml(config)
    metrics_cluster = config.get("collector", {}).get("metricsCluster")
    if metrics_cluster not in (None, VLLM_CLUSTER, ADMIN_CLUSTER, kv_events.get("cluster", RELAY_CLUSTER)):
        relays = metrics_cluster_yaml(metrics_cluster) + relays
    if baseline:
        collector = ""
        routing_filter = ""
        state = ""
        stats_config = ""
        relays = ""
        title = "Envoy 1.40 baseline bootstrap WITHOUT kvroute (round robin)"

    client_listener = _routing_listener_yaml(
        "kvroute", listen_address, listen_port, buffer_limit, routing_filter
    ).lstrip("\n")
    return f"""# {title}. Generated by envoy/render.py; see envoy/README.md.
# Envoy needs a node id/cluster to read EDS from a file; the values are free.
node: {{id: kvroute, cluster: kvroute}}
admin:
  address:
    socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}
{stats_config}{collector}
static_resources:
  listeners:
{client_listener}
{state}
  clusters:
{_vllm_cluster_yaml(endpoints, eds_file, buffer_limit)}
  - name: {ADMIN_CLUSTER}
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: {ADMIN_CLUSTER}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}}}
{relays}"""


def eds_document(endpoints, version="1", cluster=VLLM_CLUSTER):
    """An EDS file (DiscoveryResponse as JSON) for `--eds-file`."""
    lb_endpoints = []
    for e in endpoints:
        host, port = parse_hostport(e)
        lb_endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}})
    return {
        "version_info": str(version),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": cluster,
                "endpoints": [{"lb_endpoints": lb_endpoints}] if lb_endpoints else [],
            }
        ],
    }


def write_eds_file(path, endpoints, version):
    """Replace an EDS file atomically: Envoy reloads on the rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(eds_document(endpoints, version), f, indent=2)
    os.rename(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen-address", default="127.0.0.1", help="listener bind address (default 127.0.0.1)")
    p.add_argument("--listen-port", type=int, default=10000, help="listener port (default 10000)")
    p.add_argument("--admin-port", type=int, default=9901, help="admin port, bound on 127.0.0.1 (default 9901)")
    p.add_argument("--endpoints", default="", help="comma-separated ip:port list of model servers (STATIC cluster)")
    p.add_argument("--eds-file", help="take cluster membership from this EDS file instead (written if missing)")
    p.add_argument("--plugin-config", help=f"plugin configuration JSON (default {os.path.relpath(DEFAULT_PLUGIN_CONFIG, REPO)})")
    p.add_argument("--wasm", default=DEFAULT_WASM, help="path of kvroute_wasm.wasm")
    p.add_argument("--buffer-limit-bytes", type=int, default=DEFAULT_BUFFER_LIMIT_BYTES)
    p.add_argument("--refresh-ms", type=int, default=500, help="discovery refresh period with --eds-file")
    p.add_argument("--baseline", action="store_true",
                   help="same listener and cluster WITHOUT kvroute (round robin), for comparisons")
    p.add_argument("--state-listener", metavar="IP:PORT",
                   help="add an internal listener serving the shared state (GET --state-path) there, "
                        "for example 127.0.0.1:9903; the client listener serves none with the shipped config")
    p.add_argument("--state-path", default=DEFAULT_STATE_PATH,
                   help=f"path of the state on --state-listener (default {DEFAULT_STATE_PATH})")
    p.add_argument("--debug-listener", metavar="IP:PORT",
                   help="add an internal listener that routes like the client one and adds x-kvroute-decision "
                        "(routing.debugHeader) there only; bind it to 127.0.0.1 or an operator-only address")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    args = p.parse_args(argv)

    endpoints = [e for e in args.endpoints.split(",") if e.strip()]
    plugin_config = None
    if args.plugin_config:
        with open(args.plugin_config) as f:
            plugin_config = json.load(f)
    if not args.baseline and not os.path.exists(args.wasm):
        print(
            f"render.py: warning: {args.wasm} does not exist yet; build it with\n"
            "  cargo build --release --target wasm32-wasip1 -p kvroute-wasm",
            file=sys.stderr,
        )
    if args.eds_file and not os.path.exists(args.eds_file):
        write_eds_file(args.eds_file, [], "0")
    try:
        text = render(
            listen_address=args.listen_address,
            listen_port=args.listen_port,
            admin_port=args.admin_port,
            endpoints=endpoints,
            eds_file=args.eds_file,
            plugin_config=plugin_config,
            wasm=args.wasm,
            buffer_limit=args.buffer_limit_bytes,
            refresh_ms=args.refresh_ms,
            baseline=args.baseline,
            state_listener=args.state_listener,
            state_path=args.state_path,
            debug_listener=args.debug_listener,
        )
    except ValueError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
