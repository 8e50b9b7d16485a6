"""Body-based routing (`routing.modelHeader`): one listener, one cluster per
model, chosen by Envoy's route on a header kvroute sets from the body's
`model` (the Gateway API Inference Extension's body-based router).

render.py's bootstrap is edited to have two model clusters, `vllm_a` (server
A, model-a) and `vllm_b` (server B, model-b), each with the override_host
policy, and routes that match `x-kvroute-model`; a request without the
header goes to `vllm_a`. The filter sets the header only after it has read
the body, so the route Envoy picked at the request's headers must be picked
again (Envoy 1.40 clears the route cache when a wasm filter changes request
headers): model-b requests reaching server B show that it is. A client's
copy of the header never picks the route: it is removed on every request,
also when the body does not parse or is not read at all.
"""

import json
import os

from conftest import Envoy, Process, completion, free_ports, plugin_config, post, request, text, wait_until
import render

MODEL_HEADER = "x-kvroute-model"

CLIENT_ROUTE = """              routes:
              - match: {prefix: "/"}
                route:
                  cluster: vllm
"""
MODEL_ROUTES = f"""              routes:
              - match:
                  prefix: "/"
                  headers: [{{name: {MODEL_HEADER}, string_match: {{exact: model-b}}}}]
                route:
                  cluster: vllm_b
                  timeout: 0s
              - match: {{prefix: "/"}}
                route:
                  cluster: vllm_a
"""


def _cluster(text_yaml, name, address):
    """render.py's `vllm` cluster, renamed, with `address` as its one member."""
    start = text_yaml.index("  - name: vllm\n")
    end = text_yaml.index("  - name: envoy_admin\n")
    block = text_yaml[start:end]
    host, port = address.rsplit(":", 1)
    lines = [l for l in block.splitlines(keepends=True) if "- endpoint: {address:" not in l]
    out = "".join(lines).replace("  - name: vllm\n", f"  - name: {name}\n", 1)
    out = out.replace("      cluster_name: vllm\n", f"      cluster_name: {name}\n", 1)
    member = f"        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}\n"
    return out.replace("      - lb_endpoints:\n", "      - lb_endpoints:\n" + member, 1)


def _start(artifacts, tmp_path, a, b):
    port, admin_port = free_ports(2)
    cfg = plugin_config(routing={"modelHeader": MODEL_HEADER})
    t = render.render(listen_port=port, admin_port=admin_port, endpoints=[a, b], plugin_config=cfg,
                      wasm=artifacts["wasm"])
    assert t.count(CLIENT_ROUTE) == 1, "render.py's bootstrap changed"
    t = t.replace(CLIENT_ROUTE, MODEL_ROUTES, 1)
    clusters = _cluster(t, "vllm_a", a) + _cluster(t, "vllm_b", b)
    t = t.replace("  - name: envoy_admin\n", clusters + "  - name: envoy_admin\n", 1)
    path = str(tmp_path / "body-routing.yaml")
    with open(path, "w") as f:
        f.write(t)
    args = ["envoy", "-c", path, "--concurrency", "2", "--use-dynamic-base-id",
            "--log-level", os.environ.get("KVROUTE_E2E_ENVOY_LOG", "warning")]
    proc = Process("envoy-body-routing", args, str(tmp_path / "body-routing.log"))
    e = Envoy(proc, port, admin_port, path)

    def live():
        if not proc.alive():
            raise AssertionError(f"Envoy exited; log:\n{proc.log_text()}")
        try:
            r = e.admin("/ready")
            return r.status == 200 and r.body.strip() == b"LIVE"
        except OSError:
            return False

    try:
        wait_until(live, timeout=60, what="Envoy /ready == LIVE")
    except BaseException:
        proc.stop()
        raise
    return e


def test_each_model_reaches_its_own_cluster_and_a_client_header_picks_nothing(fleet, artifacts, tmp_path):
    a = fleet(1, "--model", "model-a").addresses[0]
    b = fleet(1, "--model", "model-b").addresses[0]
    e = _start(artifacts, tmp_path, a, b)
    try:
        # Each model reaches its own cluster's server, whatever kvroute's pick
        # (a pick outside the route's cluster falls back to its members).
        for i in range(4):
            for model, want in (("model-a", a), ("model-b", b)):
                r = completion(e.port, text(f"{model}-{i}", 400), model=model)
                assert r.status == 200 and r.served_by == want, (model, r)
            r = post(e.port, "/v1/messages", {"model": "model-b", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": text(f"m-{i}", 200)}]})
            assert r.status == 200 and r.served_by == b, r
        # A client's header is replaced by the body's model...
        r = completion(e.port, text("spoof-a", 400), model="model-a", headers={MODEL_HEADER: "model-b"})
        assert r.status == 200 and r.served_by == a, r
        # ...and removed when the body gives none: no model, a body that does
        # not parse (fail-open: passed on unrouted), a path kvroute does not
        # parse, a GET.
        r = post(e.port, "/v1/completions", {"prompt": "no model", "max_tokens": 2}, {MODEL_HEADER: "model-b"})
        assert r.served_by == a, r
        r = request(e.port, "POST", "/v1/completions", b"{not json", {"content-type": "application/json",
                                                                    MODEL_HEADER: "model-b"})
        assert r.served_by == a, r
        r = request(e.port, "GET", "/v1/models", headers={MODEL_HEADER: "model-b"})
        assert r.status == 200 and r.served_by == a, r
        r = post(e.port, "/v1/messages/count_tokens", {"model": "model-b", "messages": []}, {MODEL_HEADER: "model-b"})
        assert r.served_by == a, r
        e.assert_alive()
        assert e.wasm_failures() == {}
    finally:
        e.process.stop()
