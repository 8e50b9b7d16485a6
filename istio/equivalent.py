#!/usr/bin/env python3
"""Render the Envoy configuration that istio/<shape>/ patches in, as one
equivalent Envoy 1.40 bootstrap plus an ECDS file and a CDS file.

Two variants: `lease` (istio/<shape>/, the primary install: the EnvoyFilter
alone, collector.mode lease, no singleton) and `singleton` (the optional
alternative istio/singleton/<shape>/: the same EnvoyFilter with
collector.mode singleton, plus the collector from the bootstrap override).

What Istio would do, step by step, and what stands in for it here:

- istiod generates an outbound listener for port 8000 (sidecar) or 8080
  (gateway) with an HTTP connection manager whose last filter is the router,
  the VirtualService route `kvroute-models` (timeout, retries, Istio's default
  previous_hosts retry predicate), and an EDS cluster
  `outbound|8000||vllm.models.svc.cluster.local` with Istio's default
  LEAST_REQUEST policy. Here: the same objects, built in Python, with the
  cluster's members read from an EDS file and the listener bound to a free
  127.0.0.1 port.
- istiod applies the EnvoyFilter patches (INSERT_BEFORE, MERGE with protobuf
  merge semantics: messages merge, lists append, scalars replace). Here: the
  same operations on the same objects, read from the shipped envoyfilter.yaml.
  A CLUSTER ADD (envoy_admin) reaches Envoy over CDS, as from istiod: here
  from a CDS file, with the admin port replaced by the local one.
- istiod serves the EXTENSION_CONFIG over ECDS and the agent rewrites its
  remote module (oci:// or https://) to a local file, stripping ISTIO_META_*
  VM variables. Here: the extension config is written, rewritten the same way,
  as a TypedExtensionConfig discovery response into a file, and the HTTP
  filter's config source (ADS in the mesh) points at that file
  (path_config_source). Only the config source differs.
- The collector's ORIGINAL_DST clusters (kvroute_relays, kvroute_metrics)
  carry Istio's client mTLS: secrets `default` and `ROOTCA` from the agent
  over the bootstrap's `sds-grpc` cluster. Two stand-ins, chosen by
  `mesh_certs`:
  - None (the default): model servers without sidecars, as the emulators
    are: the transport_socket of those clusters is deleted, the step
    istio/README.md gives for servers outside the mesh.
  - a directory from make_mesh_certs(): Istio STRICT. The secrets come from
    files (path_config_source) instead of sds-grpc; only the config source
    differs. The model servers' clusters get the ISTIO_MUTUAL socket that
    istiod's auto-mTLS gives them for sidecar-injected pods, and
    inbound_sidecars() writes the pods' side: an Envoy that terminates mTLS
    with a client certificate required, as a STRICT inbound listener does.
- singleton variant only: Envoy merges the bootstrap override
  (kvroute-bootstrap.yaml) into Istio's bootstrap. Here: the same merge; the
  module path is replaced by the local one. The lease variant has no override
  and so no bootstrap extension.

Used by scripts/istio-check.sh (envoy --mode validate) and by
tests/e2e/test_istio_ecds.py (routing and the collector end to end). Needs
PyYAML.
"""

import copy
import json
import os
import subprocess
import sys

import yaml

ISTIO = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(ISTIO)
sys.path.insert(0, os.path.join(REPO, "envoy"))
import render  # noqa: E402

WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
SHAPES = {
    # shape: (Istio patch context, logical listener port, VirtualService file)
    "sidecar": ("SIDECAR_OUTBOUND", 8000, "virtualservice.yaml"),
    "gateway": ("GATEWAY", 8080, "gateway.yaml"),
}
MODEL_SERVICE = "vllm.models.svc.cluster.local"
MODEL_PORT = 8000
MODEL_CLUSTER = f"outbound|{MODEL_PORT}||{MODEL_SERVICE}"
# A second service on the same listener, which the filter must leave alone.
OTHER_SERVICE = "other.models.svc.cluster.local"
OTHER_CLUSTER = f"outbound|{MODEL_PORT}||{OTHER_SERVICE}"
OTHER_HOST = "other.models.svc.cluster.local"
# Mesh identities (SPIFFE URI SANs, as Istio's CA issues them): the model
# servers' namespace is the Service's; the trust domain is Istio's default.
TRUST_DOMAIN = "cluster.local"
MODEL_NAMESPACE = MODEL_SERVICE.split(".")[1]
MODEL_SERVER_SAN = f"spiffe://{TRUST_DOMAIN}/ns/{MODEL_NAMESPACE}/sa/vllm"
CLIENT_SAN = f"spiffe://{TRUST_DOMAIN}/ns/llm-clients/sa/llm-client"
# Istio's ISTIO_MUTUAL upstream TLS (pilot/pkg/networking/core/cluster_tls.go,
# buildUpstreamClusterTLSContext; the SDS configs of pkg/model's
# ConstructSdsSecretConfig): the agent's secrets over the bootstrap's sds-grpc.
SDS_CLUSTER = "sds-grpc"
SDS_CERTIFICATE = "default"
SDS_ROOT = "ROOTCA"
# What Istio's istio.alpn filter offers for an HTTP/1.1 upstream
# (pilot/pkg/xds/filters/filters.go, mtlsHTTP11ALPN). A STRICT inbound
# listener whose port protocol is sniffed sends TLS with one of
# istio-http/1.0, istio-http/1.1, istio-h2 to its HTTP chain, and any other
# TLS to a TCP proxy (filterchain_options.go, inboundStrictFilterChainMatchOptions).
ALPN_HTTP11 = ["istio-http/1.1", "istio", "http/1.1"]
INBOUND_HTTP_ALPNS = ["istio-http/1.0", "istio-http/1.1", "istio-h2"]
TLS_SOCKET = "envoy.transport_sockets.tls"
UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
DOWNSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"


def sds_grpc_config(name):
    """An SdsSecretConfig as Istio writes it for the agent's secrets."""
    return {"name": name, "sds_config": {
        "api_config_source": {
            "api_type": "GRPC",
            "set_node_on_first_message_only": True,
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": SDS_CLUSTER}}],
        },
        "initial_fetch_timeout": "0s",
        "resource_api_version": "V3",
    }}


def istio_mutual_socket(alpn, san_matchers, sni=None):
    """The transport_socket of an Istio ISTIO_MUTUAL cluster: TLS 1.2-1.3, the
    workload certificate and the mesh root from SDS, the SANs to accept."""
    ctx = {
        "@type": UPSTREAM_TLS,
        "common_tls_context": {
            "tls_params": {"tls_minimum_protocol_version": "TLSv1_2", "tls_maximum_protocol_version": "TLSv1_3"},
            "alpn_protocols": list(alpn),
            "tls_certificate_sds_secret_configs": [sds_grpc_config(SDS_CERTIFICATE)],
            "combined_validation_context": {
                "default_validation_context": {"match_typed_subject_alt_names": san_matchers},
                "validation_context_sds_secret_config": sds_grpc_config(SDS_ROOT),
            },
        },
    }
    if sni:
        ctx["sni"] = sni
    return {"name": TLS_SOCKET, "typed_config": ctx}


def collector_socket():
    """What the manifests' patches 7 and 8 add to render.py's clusters: Istio's
    client mTLS to whichever pod the collector names, accepting any workload of
    the model servers' namespace (the pods' service accounts are not known
    here; Istio's own clusters match the Service's accounts exactly)."""
    return istio_mutual_socket(ALPN_HTTP11, [{"san_type": "URI", "matcher": {
        "prefix": f"spiffe://{TRUST_DOMAIN}/ns/{MODEL_NAMESPACE}/"}}])


def make_mesh_certs(d):
    """A stand-in for Istio's CA, with openssl: ca.pem, and client.pem /
    server.pem (with their -key.pem) whose only name is a SPIFFE URI SAN, as
    Istio's workload certificates: the client is a mesh workload (the
    collector's proxy), the server a model server's pod."""
    os.makedirs(d, exist_ok=True)

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca-key.pem",
        "-out", "ca.pem", "-days", "2", "-subj", f"/O={TRUST_DOMAIN}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, san in (("client", CLIENT_SAN), ("server", MODEL_SERVER_SAN)):
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(f"subjectAltName=critical,URI:{san}\nbasicConstraints=critical,CA:FALSE\n"
                    "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
        run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}-key.pem", "-out", f"{name}.csr", "-subj", "/O=kvroute-test")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext")
    return os.path.abspath(d)


def _write_json(path, doc):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.rename(path + ".tmp", path)


def write_sds_files(sds_dir, certs):
    """The agent's two secrets as SDS files: {secret name: path}."""
    secrets = {
        SDS_CERTIFICATE: {"tls_certificate": {
            "certificate_chain": {"filename": os.path.join(certs, "client.pem")},
            "private_key": {"filename": os.path.join(certs, "client-key.pem")}}},
        SDS_ROOT: {"validation_context": {"trusted_ca": {"filename": os.path.join(certs, "ca.pem")}}},
    }
    paths = {}
    for name, body in secrets.items():
        paths[name] = os.path.join(sds_dir, f"{name}.json")
        _write_json(paths[name], {"version_info": "1", "resources": [dict({"@type": SECRET_TYPE, "name": name}, **body)]})
    return paths


def sds_from_files(doc, paths):
    """doc with every SDS secret config that is Istio's (sds-grpc) reading the
    secret's file instead; the number replaced. Anything else is left alone."""
    count = 0

    def walk(x):
        nonlocal count
        if isinstance(x, dict):
            if set(x) == {"name", "sds_config"} and x == sds_grpc_config(x["name"]):
                count += 1
                return {"name": x["name"], "sds_config": {
                    "path_config_source": {"path": paths[x["name"]], "watched_directory": {"path": os.path.dirname(paths[x["name"]])}},
                    "resource_api_version": "V3"}}
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    out = walk(doc)
    return out, count


def inbound_sidecars(workdir, certs, pods, admin_port):
    """The model pods' inbound sidecars under STRICT, as one Envoy: for each
    pod address (ip:port) the app address it forwards to. Like Istio's inbound
    listener for a port with a sniffed protocol: TLS only, a client
    certificate from the mesh CA required; the HTTP chain for the istio-http/*
    ALPNs, a TCP proxy for other TLS; plain text matches no chain and is
    closed. Stats: http.inbound_http_<i>.* and tcp.inbound_tcp_<i>.*.
    Returns the bootstrap's path."""
    tls = {"name": TLS_SOCKET, "typed_config": {
        "@type": DOWNSTREAM_TLS,
        "require_client_certificate": True,
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_certificates": [{"certificate_chain": {"filename": os.path.join(certs, "server.pem")},
                                  "private_key": {"filename": os.path.join(certs, "server-key.pem")}}],
            "validation_context": {"trusted_ca": {"filename": os.path.join(certs, "ca.pem")}},
        },
    }}
    listeners, clusters = [], []
    for i, (pod, app) in enumerate(sorted(pods.items())):
        ip, port = pod.rsplit(":", 1)
        app_ip, app_port = app.rsplit(":", 1)
        cluster = f"inbound|{port}||app-{i}"
        clusters.append({"name": cluster, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
            "cluster_name": cluster, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": app_ip, "port_value": int(app_port)}}}}]}]}})
        hcm = {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": f"inbound_http_{i}",
            "route_config": {"virtual_hosts": [{"name": "inbound", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s"}}]}]},
            "http_filters": [{"name": ROUTER, "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        }
        tcp = {"@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
               "stat_prefix": f"inbound_tcp_{i}", "cluster": cluster}
        listeners.append({
            "name": f"inbound_{ip}_{port}",
            "address": {"socket_address": {"address": ip, "port_value": int(port)}},
            "listener_filters": [{"name": "envoy.filters.listener.tls_inspector", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}}],
            "filter_chains": [
                {"name": "mtls-http", "filter_chain_match": {"transport_protocol": "tls", "application_protocols": INBOUND_HTTP_ALPNS},
                 "transport_socket": tls, "filters": [{"name": HCM, "typed_config": hcm}]},
                {"name": "mtls-tcp", "filter_chain_match": {"transport_protocol": "tls"},
                 "transport_socket": tls, "filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": tcp}]},
            ],
        })
    boot = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
            "static_resources": {"listeners": listeners, "clusters": clusters}}
    path = os.path.join(workdir, "inbound-sidecars.json")
    _write_json(path, boot)
    return path


# variant: the directory of its manifests (the VirtualService / Gateway file
# is the primary's in both).
VARIANTS = {
    "lease": ISTIO,
    "singleton": os.path.join(ISTIO, "singleton"),
}


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def shape_docs(shape, variant="lease", root=ISTIO):
    """Every YAML document of the variant's <shape>/ directory, by file name
    (for the singleton variant, plus the primary's VirtualService file).
    root: a copy of istio/'s layout (build-oci.py --manifests) instead."""
    d = os.path.join(root, os.path.relpath(VARIANTS[variant], ISTIO), shape)
    docs = {name: load_docs(os.path.join(d, name)) for name in sorted(os.listdir(d)) if name.endswith(".yaml")}
    vs_file = SHAPES[shape][2]
    if vs_file not in docs:
        docs[vs_file] = load_docs(os.path.join(root, shape, vs_file))
    return docs


def deep_update(doc, patch):
    """JSON merge: objects merge, everything else replaces."""
    out = copy.deepcopy(doc)
    for k, v in patch.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def patch_plugin_json(wasm_config, plugin_patch):
    """Apply a test-only change (e.g. routing.statePath) to the plugin JSON of
    a Wasm filter or service config, in place."""
    if plugin_patch:
        c = wasm_config["configuration"]
        c["value"] = json.dumps(deep_update(json.loads(c["value"]), plugin_patch))


def one(docs, kind):
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"expected one {kind}, found {len(found)}")
    return found[0]


def proto_merge(dst, src):
    """Protobuf MergeFrom on JSON objects: messages merge, lists append,
    scalars replace. (An Any whose @type changes is replaced whole.)"""
    if isinstance(dst, dict) and isinstance(src, dict):
        if "@type" in src and dst.get("@type") not in (None, src["@type"]):
            return copy.deepcopy(src)
        out = dict(dst)
        for k, v in src.items():
            out[k] = proto_merge(dst[k], v) if k in dst else copy.deepcopy(v)
        return out
    if isinstance(dst, list) and isinstance(src, list):
        return dst + copy.deepcopy(src)
    return copy.deepcopy(src)


def agent_rewrite(ext_config, wasm_path):
    """What Istio's agent does to a Wasm ECDS resource with remote code
    (pkg/wasm/convert.go): the module becomes a local file (here: wasm_path,
    standing for the agent's cache file) and ISTIO_META_* VM variables go."""
    ec = copy.deepcopy(ext_config)
    vm = ec["typed_config"]["config"]["vm_config"]
    if "remote" not in vm.get("code", {}):
        raise ValueError("the extension config's module is not remote; the agent would not fetch it")
    vm["code"] = {"local": {"filename": wasm_path}}
    env = vm.get("environment_variables", {}).get("key_values", {})
    for k in [k for k in env if k.startswith("ISTIO_META")]:
        del env[k]
    return ec


def vs_routes(vs):
    """The Envoy routes istiod builds for the VirtualService's http routes
    (pilot/pkg/networking/core/route: name, timeout, retry policy with the
    previous_hosts predicate and 5 host selection attempts)."""
    routes = []
    for http in vs["spec"]["http"]:
        dest = http["route"][0]["destination"]
        r = {
            "name": http["name"],
            "match": {"prefix": "/"},
            "route": {
                "cluster": f"outbound|{dest['port']['number']}||{dest['host']}",
                "timeout": http.get("timeout", "0s"),
            },
        }
        retries = http.get("retries")
        if retries and retries.get("attempts", 0) > 0:
            r["route"]["retry_policy"] = {
                "retry_on": retries["retryOn"],
                "num_retries": retries["attempts"],
                "retry_host_predicate": [{
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
                }],
                "host_selection_retry_max_attempts": 5,
            }
        routes.append(r)
    return routes


def istio_cluster(name, eds_file):
    """An outbound EDS cluster as istiod generates it by default (the parts
    that matter here): LEAST_REQUEST, common_lb_config, 10 s connect timeout,
    Istio's default circuit breakers."""
    eds_dir = os.path.dirname(os.path.abspath(eds_file))
    return {
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {
            "service_name": name,
            "eds_config": {
                "resource_api_version": "V3",
                "path_config_source": {"path": os.path.abspath(eds_file), "watched_directory": {"path": eds_dir}},
            },
        },
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {},
        "circuit_breakers": {"thresholds": [{
            "max_connections": 4294967295, "max_pending_requests": 4294967295,
            "max_requests": 4294967295, "max_retries": 4294967295,
        }]},
    }


def write_eds(path, cluster, endpoints, version):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = render.eds_document(endpoints, version, cluster=cluster)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.rename(tmp, path)


def build(shape, workdir, wasm, endpoints, listen_port, admin_port, variant="lease", plugin_patch=None, mesh_certs=None):
    """Write <workdir>/envoy.json (bootstrap), the ECDS, CDS and EDS files.
    plugin_patch: a test-only change merged into the plugin JSON of the
    filter (and the collector). mesh_certs: None for model servers without
    sidecars, or make_mesh_certs()'s directory for Istio STRICT (module
    docstring). Returns a dict of the paths and names used."""
    context, logical_port, vs_file = SHAPES[shape]
    docs = shape_docs(shape, variant)
    ef = one(docs["envoyfilter.yaml"], "EnvoyFilter")
    vs = one(docs[vs_file], "VirtualService")
    cm = one(docs["kvroute-bootstrap.yaml"], "ConfigMap") if "kvroute-bootstrap.yaml" in docs else None
    if (cm is None) != (variant == "lease"):
        raise ValueError(f"{variant} variant of {shape}: a bootstrap override {'is' if cm else 'is not'} there")
    os.makedirs(workdir, exist_ok=True)

    # The agent's module cache: a copy under another name, so the filter and the
    # collector load the module from different files, as in the mesh.
    agent_wasm = os.path.join(workdir, "agent-cache", "kvroute.wasm")
    os.makedirs(os.path.dirname(agent_wasm), exist_ok=True)
    with open(wasm, "rb") as src, open(agent_wasm, "wb") as dst:
        dst.write(src.read())

    eds = {}
    for c in (MODEL_CLUSTER, OTHER_CLUSTER):
        eds[c] = os.path.join(workdir, "eds", c.replace("|", "_") + ".json")
        write_eds(eds[c], c, endpoints, 1)

    vhosts = [
        {"name": f"{MODEL_SERVICE}:{MODEL_PORT}", "domains": ["*"], "routes": vs_routes(vs)},
        {"name": f"{OTHER_SERVICE}:{MODEL_PORT}", "domains": [OTHER_HOST],
         "routes": [{"name": "default", "match": {"prefix": "/"}, "route": {"cluster": OTHER_CLUSTER, "timeout": "0s"}}]},
    ]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"outbound_0.0.0.0_{logical_port}",
        "route_config": {"name": str(logical_port), "virtual_hosts": vhosts},
        "http_filters": [{"name": ROUTER, "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    listener = {
        "name": f"0.0.0.0_{logical_port}",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        "filter_chains": [{"filters": [{"name": HCM, "typed_config": hcm}]}],
    }
    clusters = {c: istio_cluster(c, eds[c]) for c in (MODEL_CLUSTER, OTHER_CLUSTER)}

    ecds_file = os.path.join(workdir, "ecds", "kvroute.json")
    cds_file = os.path.join(workdir, "cds", "clusters.json")
    ext_configs = []
    added_clusters = []
    applied = []
    for p in ef["spec"]["configPatches"]:
        to, op, value = p["applyTo"], p["patch"]["operation"], p["patch"]["value"]
        match = p.get("match", {})
        if to != "EXTENSION_CONFIG" and match.get("context") != context:
            raise ValueError(f"{shape}: patch {to} has context {match.get('context')}, expected {context}")
        if to == "EXTENSION_CONFIG":
            assert op == "ADD", "Istio applies only ADD to EXTENSION_CONFIG"
            ec = agent_rewrite(value, agent_wasm)
            patch_plugin_json(ec["typed_config"]["config"], plugin_patch)
            ext_configs.append(ec)
        elif to == "HTTP_FILTER":
            lm = match["listener"]
            assert lm["portNumber"] == logical_port
            assert lm["filterChain"]["filter"]["name"] == HCM
            assert lm["filterChain"]["filter"]["subFilter"]["name"] == ROUTER and op == "INSERT_BEFORE"
            f = copy.deepcopy(value)
            if "config_discovery" in f:
                cs = f["config_discovery"]["config_source"]
                assert "ads" in cs, "Istio serves ECDS over ADS"
                del cs["ads"]
                cs["path_config_source"] = {"path": ecds_file, "watched_directory": {"path": os.path.dirname(ecds_file)}}
            # Patches apply in order: each INSERT_BEFORE the router lands
            # after the ones before it.
            filters = hcm["http_filters"]
            i = [x["name"] for x in filters].index(ROUTER)
            filters.insert(i, f)
        elif to == "HTTP_ROUTE":
            rm = match["routeConfiguration"]
            assert rm["portNumber"] == logical_port and op == "MERGE"
            name = rm["vhost"]["route"]["name"]
            hits = 0
            for vh in vhosts:
                for i, r in enumerate(vh["routes"]):
                    if r["name"] == name:
                        vh["routes"][i] = proto_merge(r, value)
                        hits += 1
            assert hits == 1, f"route {name}: {hits} matches"
        elif to == "LISTENER":
            assert match["listener"]["portNumber"] == logical_port and op == "MERGE"
            listener = proto_merge(listener, value)
        elif to == "CLUSTER" and op == "ADD":
            # InsertedClusters: the value as it is, for the patch's context;
            # match.cluster is not read. The admin port is the local one.
            assert "cluster" not in match, "a CLUSTER ADD matches on context only"
            c = json.loads(json.dumps(value).replace('"port_value": 15000', f'"port_value": {admin_port}'))
            assert c["name"] not in clusters, c["name"]
            added_clusters.append(c)
        elif to == "CLUSTER":
            cmatch = match["cluster"]
            name = f"outbound|{cmatch['portNumber']}||{cmatch['service']}"
            assert name in clusters and op == "MERGE", name
            clusters[name] = proto_merge(clusters[name], value)
        else:
            raise ValueError(f"{shape}: unexpected patch {to}")
        applied.append(to)

    sds_files = None
    if mesh_certs is None:
        # Model servers without sidecars: the documented step, the added
        # clusters' transport_socket deleted (plain HTTP to the pods).
        for c in added_clusters:
            c.pop("transport_socket", None)
    else:
        # STRICT: the agent's secrets from files, and the model servers'
        # clusters as auto-mTLS makes them for sidecar-injected pods
        # (ISTIO_MUTUAL, SNI the cluster's, the Service's account as SAN; the
        # ALPN is what istio.alpn puts on their HTTP/1.1 requests).
        sds_files = write_sds_files(os.path.join(workdir, "sds"), mesh_certs)
        added_clusters, _ = sds_from_files(added_clusters, sds_files)
        for name, c in clusters.items():
            direction, port, subset, host = name.split("|")
            sni = f"{direction}_.{port}_.{subset}_.{host}"  # Istio's SNI for outbound|8000||host
            socket = istio_mutual_socket(ALPN_HTTP11, [{"san_type": "URI", "matcher": {"exact": MODEL_SERVER_SAN}}], sni)
            c["transport_socket"], n = sds_from_files(socket, sds_files)
            assert n == 2, n

    os.makedirs(os.path.dirname(cds_file), exist_ok=True)
    with open(cds_file + ".tmp", "w") as f:
        json.dump({"version_info": "1", "resources": [
            dict({"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster"}, **c) for c in added_clusters]}, f, indent=1)
    os.rename(cds_file + ".tmp", cds_file)

    os.makedirs(os.path.dirname(ecds_file), exist_ok=True)
    ecds_doc = {"version_info": "1", "resources": [
        dict({"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"}, **ec) for ec in ext_configs]}
    tmp = ecds_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(ecds_doc, f, indent=1)
    os.rename(tmp, ecds_file)

    # Istio's bootstrap (the parts that matter here), then Envoy's merge of
    # the bootstrap override.
    bootstrap = {
        "node": {"id": f"{'router' if shape == 'gateway' else 'sidecar'}~127.0.0.1~kvroute.test~test.svc.cluster.local",
                 "cluster": "kvroute.test"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [listener], "clusters": list(clusters.values())},
        "dynamic_resources": {"cds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": cds_file, "watched_directory": {"path": os.path.dirname(cds_file)}},
        }},
    }
    if cm is not None:
        override = json.loads(cm["data"]["custom_bootstrap.json"])
        text = json.dumps(override)
        text = text.replace('"port_value": 15000', f'"port_value": {admin_port}')
        override = json.loads(text)
        for ext in override.get("bootstrap_extensions", []):
            ext["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": os.path.abspath(wasm)}}
            patch_plugin_json(ext["typed_config"]["config"], plugin_patch)
        bootstrap = proto_merge(bootstrap, override)
    config_path = os.path.join(workdir, "envoy.json")
    with open(config_path, "w") as f:
        json.dump(bootstrap, f, indent=1)
    return {"config": config_path, "ecds": ecds_file, "cds": cds_file, "eds": eds, "applied": applied,
            "model_cluster": MODEL_CLUSTER, "other_host": OTHER_HOST, "variant": variant, "sds": sds_files,
            "added_clusters": [c["name"] for c in added_clusters]}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="lease")
    ap.add_argument("workdir")
    ap.add_argument("--wasm", default=render.DEFAULT_WASM)
    ap.add_argument("--endpoints", default="127.0.0.1:18001,127.0.0.1:18002")
    ap.add_argument("--listen-port", type=int, default=10000)
    ap.add_argument("--admin-port", type=int, default=9901)
    ap.add_argument("--strict", action="store_true",
                    help="the Istio STRICT stand-in: test certificates in WORKDIR/certs, the mesh secrets from files")
    a = ap.parse_args()
    certs = make_mesh_certs(os.path.join(a.workdir, "certs")) if a.strict else None
    out = build(a.shape, a.workdir, a.wasm, a.endpoints.split(","), a.listen_port, a.admin_port, a.variant, mesh_certs=certs)
    print(json.dumps(out, indent=1))
