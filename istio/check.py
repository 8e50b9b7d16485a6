#!/usr/bin/env python3
"""Validate istio/: every manifest against Istio's CRD schemas, the names the
manifests share with each other and with envoy/render.py, the OCI builder,
and (when Envoy and the module are there) the equivalent bootstraps in Envoy.

    python3 istio/check.py [--schemas DIR] [--no-envoy]

Schemas: $KVROUTE_ISTIO_SCHEMAS, else <repo>/testdata/istio (a copy of
../shared/istio's file; a differing ../shared/istio is reported). Needs PyYAML
and jsonschema (scripts/istio-check.sh installs them). Exit status 1 on any
problem.
"""

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

import jsonschema
import yaml

ISTIO = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(ISTIO)
sys.path.insert(0, ISTIO)
sys.path.insert(0, os.path.join(ISTIO, "oci"))
sys.path.insert(0, os.path.join(REPO, "envoy"))
import equivalent  # noqa: E402
import render  # noqa: E402

build_oci = __import__("build-oci")

problems = []


def problem(msg):
    problems.append(msg)
    print(f"  FAIL {msg}")


def ok(msg):
    print(f"  ok   {msg}")


def expect(cond, msg):
    (ok if cond else problem)(msg)


# ---------------------------------------------------------------- schemas


def strict(schema):
    """Kubernetes rejects unknown fields (kubectl's default strict field
    validation) except under x-kubernetes-preserve-unknown-fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def load_crds(path):
    crds = {}
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for v in doc["spec"]["versions"]:
                if v.get("served"):
                    schema = strict(v["schema"]["openAPIV3Schema"])
                    # Every object also has the Kubernetes envelope.
                    schema["properties"].update(
                        apiVersion={"type": "string"}, kind={"type": "string"},
                        metadata={"type": "object", "required": ["name"]})
                    crds[(f"{group}/{v['name']}", kind)] = schema
    return crds


def cel_checks(doc, where):
    """The CEL rules (x-kubernetes-validations) that matter for these kinds."""
    spec = doc.get("spec", {})
    if doc["kind"] == "EnvoyFilter":
        expect(not ("workloadSelector" in spec and "targetRefs" in spec), f"{where}: not both workloadSelector and targetRefs")
        for i, p in enumerate(spec.get("configPatches", [])):
            m = p.get("match", {})
            expect(("waypoint" in m) == (m.get("context") == "WAYPOINT") or "waypoint" not in m,
                   f"{where}: patch {i}: waypoint match only with context WAYPOINT")


def validate_schemas(crds, manifests):
    print("schemas:")
    for path, docs in manifests.items():
        rel = os.path.relpath(path, REPO)
        for i, doc in enumerate(docs):
            where = f"{rel}#{i} {doc.get('kind', '?')}"
            api = doc.get("apiVersion", "")
            if "istio.io" in api:
                schema = crds.get((api, doc.get("kind")))
                if schema is None:
                    problem(f"{where}: {api} {doc.get('kind')} is not a served version in the CRDs")
                    continue
                errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
                for e in errors:
                    problem(f"{where}: {'/'.join(map(str, e.path))}: {e.message[:300]}")
                if not errors:
                    ok(f"{where} validates against the {doc['kind']} CRD schema")
                cel_checks(doc, where)
            elif api == "v1" and doc.get("kind") == "ConfigMap":
                try:
                    json.loads(doc["data"]["custom_bootstrap.json"])
                    ok(f"{where}: custom_bootstrap.json is JSON")
                except (KeyError, ValueError) as e:
                    problem(f"{where}: custom_bootstrap.json: {e}")
            elif "kind" not in doc and "spec" in doc:  # a pod-template patch
                ann = doc["spec"]["template"]["metadata"].get("annotations", {})
                for k in ("sidecar.istio.io/userVolume", "sidecar.istio.io/userVolumeMount"):
                    if k in ann:
                        try:
                            json.loads(ann[k])
                        except ValueError as e:
                            problem(f"{where}: {k} is not JSON: {e}")
                expect(ann.get("sidecar.istio.io/bootstrapOverride") == "kvroute-bootstrap",
                       f"{where}: bootstrapOverride names the ConfigMap kvroute-bootstrap")
            else:
                problem(f"{where}: unknown document")


# ---------------------------------------------------------------- names


def rendered():
    """render.py's bootstrap (the plain-Envoy reference)."""
    return yaml.safe_load(render.render(endpoints=["127.0.0.1:1"], wasm="/x.wasm"))


def patches(ef, apply_to):
    return [p for p in ef["spec"]["configPatches"] if p["applyTo"] == apply_to]


def plugin_file(variant):
    with open(os.path.join(equivalent.VARIANTS[variant], "kvroute-plugin.json")) as f:
        return json.load(f)


def without_mode(plugin):
    p = copy.deepcopy(plugin)
    p.get("collector", {}).pop("mode", None)
    return p


def cross_references(shape, docs, ref):
    """The primary install (istio/<shape>/): the EnvoyFilter alone, in
    collector.mode lease."""
    print(f"names ({shape}):")
    context, port, vs_file = equivalent.SHAPES[shape]
    ef = equivalent.one(docs["envoyfilter.yaml"], "EnvoyFilter")
    vs = equivalent.one(docs[vs_file], "VirtualService")
    plugin = plugin_file("lease")

    ref_filter = next(f for f in ref["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
                      ["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.wasm")["typed_config"]["config"]
    ref_cluster = next(c for c in ref["static_resources"]["clusters"] if c["name"] == render.VLLM_CLUSTER)
    ref_route = ref["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"][0]["route"]

    expect(not {"kvroute-bootstrap.yaml", "deployment-patch.yaml"} & set(docs),
           f"istio/{shape}/ has no bootstrap override or pod patch (the singleton alternative's, istio/singleton/{shape}/)")
    (ec,) = patches(ef, "EXTENSION_CONFIG")
    filters = patches(ef, "HTTP_FILTER")
    hf = next(p for p in filters if "config_discovery" in p["patch"]["value"])
    strips = [p for p in filters if p is not hf]
    (hr,) = patches(ef, "HTTP_ROUTE")
    (ls,) = patches(ef, "LISTENER")
    (cl,) = [p for p in patches(ef, "CLUSTER") if p["patch"]["operation"] == "MERGE"]
    added = [p for p in patches(ef, "CLUSTER") if p["patch"]["operation"] == "ADD"]
    cmatch = cl["match"]["cluster"]
    ext = ec["patch"]["value"]
    wasm = ext["typed_config"]
    cfg = wasm["config"]

    expect(wasm["@type"] == equivalent.WASM_TYPE, "EXTENSION_CONFIG is an HTTP Wasm filter config")
    expect(hf["patch"]["value"]["name"] == ext["name"], f"HTTP_FILTER name = EXTENSION_CONFIG name ({ext['name']})")
    expect(hf["patch"]["value"]["config_discovery"]["type_urls"] == [equivalent.WASM_TYPE], "HTTP_FILTER asks ECDS for the Wasm type")
    expect(list(hr["patch"]["value"]["typed_per_filter_config"]) == [ext["name"]],
           "HTTP_ROUTE enables the filter by the same name")
    expect(hf["patch"]["value"].get("disabled") is True, "the filter is off by default on the listener")
    # The client's destination header is dropped on every route, before the
    # filter: render.py's first filter, inserted before kvroute's.
    ref_strip = yaml.safe_load(textwrap.dedent(render.STRIP_DESTINATION_FILTER_YAML))[0]
    expect(len(strips) == 1 and strips[0]["patch"]["value"] == ref_strip
           and strips[0]["patch"]["operation"] == hf["patch"]["operation"] == "INSERT_BEFORE"
           and strips[0]["match"] == hf["match"]
           and ef["spec"]["configPatches"].index(strips[0]) < ef["spec"]["configPatches"].index(hf),
           "a header_mutation = render.py's drops the client's destination header, inserted before the filter")
    expect({p.get("match", {}).get("context") for p in ef["spec"]["configPatches"] if p["applyTo"] != "EXTENSION_CONFIG"} == {context},
           f"every listener/route/cluster patch has context {context}")
    expect(hf["match"]["listener"]["portNumber"] == ls["match"]["listener"]["portNumber"] == port
           and hr["match"]["routeConfiguration"]["portNumber"] == port, f"filter, route and buffer patches on port {port}")

    expect(cfg["root_id"] == ref_filter["root_id"] == "kvroute", "filter root_id kvroute (= render.py)")
    expect(cfg["vm_config"]["vm_id"] == ref_filter["vm_config"]["vm_id"] == "kvroute", "vm_id kvroute in filter and render.py")
    expect(cfg.get("allow_on_headers_stop_iteration") is True, "allow_on_headers_stop_iteration: true")
    expect(cfg.get("failure_policy") == ref_filter.get("failure_policy"), f"failure_policy = render.py ({ref_filter.get('failure_policy')})")
    expect(cfg["vm_config"]["runtime"] == "envoy.wasm.runtime.v8", "V8 runtime")

    filter_json = json.loads(cfg["configuration"]["value"])
    expect(filter_json == plugin, "the filter gets istio/kvroute-plugin.json")
    expect(plugin.get("collector", {}).get("mode") == "lease", "collector.mode is lease in the primary install (no singleton needed)")

    cluster_name = f"outbound|{cmatch['portNumber']}||{cmatch['service']}"
    dest = vs["spec"]["http"][0]["route"][0]["destination"]
    expect(f"outbound|{dest['port']['number']}||{dest['host']}" == cluster_name, f"VirtualService routes to {cluster_name}")
    expect(plugin["endpoints"]["fromCluster"]["cluster"] == cluster_name,
           "endpoints.fromCluster.cluster names the patched cluster")

    # The admin cluster: a CLUSTER ADD (istiod sends it over CDS as it is).
    admin_name = plugin["endpoints"]["fromCluster"]["adminCluster"]
    admin = [p["patch"]["value"] for p in added if p["patch"]["value"].get("name") == admin_name]
    expect(len(admin) == 1 and admin[0].get("type") == "STATIC",
           f"adminCluster {admin_name} is one CLUSTER ADD, a STATIC cluster")
    # kvEvents' relay cluster and the collector's /metrics polls: render.py's
    # clusters (plain Envoy, plain HTTP) plus Istio's client mTLS, the same
    # transport_socket on both and nothing else.
    mtls = equivalent.collector_socket()

    def plus_mtls(value, ref):
        rest = {k: v for k, v in value.items() if k != "transport_socket"}
        return rest == ref and value.get("transport_socket") == mtls

    relay_name = plugin.get("kvEvents", {}).get("cluster", render.RELAY_CLUSTER)
    relay = [p["patch"]["value"] for p in added if p["patch"]["value"].get("name") == relay_name]
    ref_relay = yaml.safe_load(render.relay_cluster_yaml(relay_name))[0]
    expect(len(relay) == 1 and plus_mtls(relay[0], ref_relay),
           f"kvEvents.cluster {relay_name} is a CLUSTER ADD equal to render.py's (ORIGINAL_DST by {render.RELAY_HOST_HEADER}) "
           "plus Istio's mTLS")
    metrics_name = plugin["collector"]["metricsCluster"]
    metrics = [p["patch"]["value"] for p in added if p["patch"]["value"].get("name") == metrics_name]
    ref_metrics = yaml.safe_load(render.metrics_cluster_yaml(metrics_name))[0]
    expect(metrics_name == render.METRICS_CLUSTER and len(metrics) == 1 and plus_mtls(metrics[0], ref_metrics),
           f"collector.metricsCluster {metrics_name} is a CLUSTER ADD equal to render.py's "
           f"(ORIGINAL_DST by {render.ORIGINAL_DST_HOST_HEADER}) plus Istio's mTLS")
    ctx = mtls["typed_config"]["common_tls_context"]
    expect(ctx["alpn_protocols"][0] == "istio-http/1.1" and "istio-peer-exchange" not in ctx["alpn_protocols"],
           "their ALPN leads with istio-http/1.1 (a STRICT inbound listener's HTTP chain), without istio-peer-exchange")
    expect([s["name"] for s in ctx["tls_certificate_sds_secret_configs"]] == ["default"]
           and ctx["combined_validation_context"]["validation_context_sds_secret_config"]["name"] == "ROOTCA"
           and json.dumps(ctx).count('"cluster_name": "sds-grpc"') == 2,
           "their certificate is SDS default and their root SDS ROOTCA, both from sds-grpc")
    sans = ctx["combined_validation_context"]["default_validation_context"]["match_typed_subject_alt_names"]
    expect(sans == [{"san_type": "URI", "matcher": {"prefix": f"spiffe://cluster.local/ns/{cmatch['service'].split('.')[1]}/"}}],
           f"they accept a server of the model service's namespace ({cmatch['service'].split('.')[1]}) only")
    expect(len(added) == 3, f"the CLUSTER ADDs are {admin_name}, {relay_name} and {metrics_name}, nothing else")
    expect(all("cluster" not in p.get("match", {}) for p in added),
           "the CLUSTER ADDs match on context only (istiod ignores match.cluster for ADD)")
    if admin:
        la = admin[0]["load_assignment"]
        sa = la["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        expect(la["cluster_name"] == admin_name and (sa["address"], sa["port_value"]) == ("127.0.0.1", 15000),
               f"{admin_name} points at the proxy's admin listener 127.0.0.1:15000")
        expect(admin_name not in {"prometheus_stats", "agent", "sds-grpc", "xds-grpc", "zipkin"},
               f"{admin_name} is not one of the static clusters of Istio's bootstrap")

    lbp = cl["patch"]["value"]["load_balancing_policy"]
    expect(lbp == ref_cluster["load_balancing_policy"], "override_host policy = render.py's (header source, fallback round robin)")
    header = lbp["policies"][0]["typed_extension_config"]["typed_config"]["override_host_sources"][0]["header"]
    expect(header == plugin["routing"]["destinationHeader"] == render.DESTINATION_HEADER, f"destination header {header} agrees")
    expect(cl["patch"]["value"].get("lb_policy") == "CLUSTER_PROVIDED", "lb_policy CLUSTER_PROVIDED, as Istio's InferencePool clusters")

    for name, value in (("listener", ls["patch"]["value"]), ("cluster", cl["patch"]["value"])):
        limit = value["per_connection_buffer_limit_bytes"]
        expect(limit == render.DEFAULT_BUFFER_LIMIT_BYTES and limit >= plugin["routing"]["maxBodyBytes"],
               f"{name} buffer limit {limit} = render.py's, >= routing.maxBodyBytes")

    http = vs["spec"]["http"][0]
    expect(hr["match"]["routeConfiguration"]["vhost"]["route"]["name"] == http["name"], f"HTTP_ROUTE matches route {http['name']}")
    rp = ref_route["retry_policy"]
    expect(http["retries"]["retryOn"] == rp["retry_on"] and http["retries"]["attempts"] == rp["num_retries"]
           and http["timeout"] == ref_route["timeout"], "VirtualService timeout and retries = render.py's route")

    remote = cfg["vm_config"]["code"]["remote"]
    uri = remote["http_uri"]["uri"]
    expect(uri.startswith(("oci://", "https://")), f"module URL {uri} is oci:// or https://")
    expect(re.fullmatch(r"[0-9a-f]{64}", remote.get("sha256", "")) is not None, "sha256 is 64 hex digits")
    gws = [d for d in docs.get(vs_file, []) if d.get("kind") == "Gateway"]
    labels = ef["spec"]["workloadSelector"]["labels"]
    for gw in gws:
        expect(all(gw["spec"]["selector"].get(k) == v for k, v in labels.items()), "Gateway selector = EnvoyFilter workloadSelector")

    # What the primary renders to: the filter over ECDS, envoy_admin and the
    # relay cluster over CDS, and no singleton (as render.py in lease mode).
    with tempfile.TemporaryDirectory() as d:
        dummy = os.path.join(d, "m.wasm")
        open(dummy, "wb").close()
        out = equivalent.build(shape, os.path.join(d, "eq"), dummy, ["127.0.0.1:1"], 1, 2)
        with open(out["config"]) as f:
            boot = json.load(f)
        with open(out["cds"]) as f:
            cds = [c["name"] for c in json.load(f)["resources"]]
    expect(not boot.get("bootstrap_extensions"), "the equivalent bootstrap has no bootstrap extension (no singleton)")
    expect(cds == [admin_name, relay_name, metrics_name],
           f"the equivalent gets {admin_name}, {relay_name} and {metrics_name} over CDS")
    lease_render = render.render(endpoints=["127.0.0.1:1"], wasm="/x.wasm", plugin_config=plugin)
    expect("envoy.bootstrap.wasm" not in lease_render, "render.py renders no singleton for the same plugin JSON")


def singleton_references(shape, docs, primary_docs, ref):
    """The optional alternative (istio/singleton/<shape>/): the primary's
    EnvoyFilter with collector.mode singleton, the bootstrap override with the
    collector, and the pod patch that mounts the module."""
    print(f"names (singleton alternative, {shape}):")
    ef = equivalent.one(docs["envoyfilter.yaml"], "EnvoyFilter")
    primary_ef = equivalent.one(primary_docs["envoyfilter.yaml"], "EnvoyFilter")
    cm = equivalent.one(docs["kvroute-bootstrap.yaml"], "ConfigMap")
    pod = docs["deployment-patch.yaml"][0]["spec"]["template"]
    plugin, primary_plugin = plugin_file("singleton"), plugin_file("lease")
    ref_service = ref["bootstrap_extensions"][0]["typed_config"]

    expect(plugin.get("collector", {}).get("mode") == "singleton", "istio/singleton/kvroute-plugin.json has collector.mode singleton")
    expect(without_mode(plugin) == without_mode(primary_plugin),
           "istio/singleton/kvroute-plugin.json = istio/kvroute-plugin.json except collector.mode")

    def cfg_of(e):
        (ec,) = patches(e, "EXTENSION_CONFIG")
        return ec["patch"]["value"]["typed_config"]["config"]

    filter_json = json.loads(cfg_of(ef)["configuration"]["value"])
    expect(filter_json == plugin, "the alternative's filter gets istio/singleton/kvroute-plugin.json")
    same = copy.deepcopy(ef)
    cfg_of(same)["configuration"]["value"] = cfg_of(primary_ef)["configuration"]["value"]
    expect(same == primary_ef, f"singleton/{shape}/envoyfilter.yaml = {shape}/envoyfilter.yaml except the plugin JSON")

    boot = json.loads(cm["data"]["custom_bootstrap.json"])
    svcs = [b for b in boot.get("bootstrap_extensions", []) if b["name"] == "envoy.bootstrap.wasm"]
    expect(len(svcs) == 1, "the bootstrap override has one envoy.bootstrap.wasm")
    if not svcs:
        return
    svc = svcs[0]["typed_config"]
    cfg = cfg_of(ef)
    expect(svc.get("singleton") is True, "the collector is a singleton")
    expect(svc["config"]["root_id"] == ref_service["config"]["root_id"] == "kvroute-collector", "collector root_id kvroute-collector (= render.py)")
    expect(svc["config"]["vm_config"]["vm_id"] == cfg["vm_config"]["vm_id"] == ref_service["config"]["vm_config"]["vm_id"] == "kvroute",
           "vm_id kvroute in filter, collector and render.py")
    expect(svc["config"]["vm_config"]["runtime"] == cfg["vm_config"]["runtime"], "same runtime in filter and collector")
    expect(svc["config"].get("failure_policy") == cfg.get("failure_policy") == ref_service["config"].get("failure_policy"),
           f"collector failure_policy = the filter's = render.py's ({cfg.get('failure_policy')})")
    expect(json.loads(svc["config"]["configuration"]["value"]) == plugin, "the collector gets the same plugin JSON as the filter")
    admin_name = plugin["endpoints"]["fromCluster"]["adminCluster"]
    static = [c["name"] for c in boot.get("static_resources", {}).get("clusters", [])]
    expect(admin_name not in static, f"the override does not define {admin_name} too (the EnvoyFilter adds it over CDS)")

    expect(svc["config"]["vm_config"]["code"]["local"]["filename"] == "/var/lib/kvroute/plugin.wasm", "collector reads /var/lib/kvroute/plugin.wasm")
    uri = cfg["vm_config"]["code"]["remote"]["http_uri"]["uri"]
    vols = pod.get("spec", {}).get("volumes") or json.loads(pod["metadata"]["annotations"].get("sidecar.istio.io/userVolume", "[]"))
    images = [v["image"]["reference"] for v in vols if "image" in v]
    if uri.startswith("oci://"):
        expect(images == [uri[len("oci://"):]], "the image volume mounts the same image the agent pulls")
    labels = ef["spec"]["workloadSelector"]["labels"]
    expect(all(pod["metadata"]["labels"].get(k) == v for k, v in labels.items()), f"workloadSelector {labels} matches the pod template")
    expect(cm["metadata"]["namespace"] == ef["metadata"]["namespace"], "ConfigMap and EnvoyFilter in the same namespace")


# ---------------------------------------------------------------- OCI


def check_oci(crds, ref):
    print("oci:")
    with tempfile.TemporaryDirectory() as d:
        wasm = os.path.join(d, "m.wasm")
        with open(wasm, "wb") as f:
            f.write(b"\0asm\x01\0\0\0" + os.urandom(64))
        a = build_oci.build(wasm, os.path.join(d, "a"), "t")
        b = build_oci.build(wasm, os.path.join(d, "b"), "t")
        expect(a["manifest_digest"] == b["manifest_digest"], "the build is reproducible (same digest twice)")
        data, digest = build_oci.read_plugin(os.path.join(d, "a"), "t")
        with open(wasm, "rb") as f:
            expect(data == f.read() and digest == a["manifest_digest"], "plugin.wasm reads back as Istio's agent reads it")
        check_written_manifests(crds, ref, a["manifest_digest"], os.path.join(d, "manifests"))


def check_written_manifests(crds, ref, manifest_digest, out):
    """build-oci.py --image --manifests: istio/'s manifests with the image and
    digest filled in, still valid, and otherwise the shipped ones."""
    image = "registry.test:5000/team/kvroute-wasm:9.9.9"
    hexdigest = manifest_digest.split(":", 1)[1]
    written = build_oci.write_manifests(image, manifest_digest, out)
    expect(len(written) == sum(1 for r in build_oci.MANIFEST_DIRS for n in os.listdir(os.path.join(ISTIO, r))
                               if n.endswith(".yaml")), f"--manifests wrote all {len(written)} manifests")
    for path in written:
        rel = os.path.relpath(path, out)
        with open(os.path.join(ISTIO, rel)) as f, open(path) as g:
            back = g.read().replace(image, build_oci.SHIPPED_IMAGE).replace(hexdigest, build_oci.PLACEHOLDER_SHA256)
            if back != f.read():
                problem(f"--manifests {rel} differs from the shipped file beyond the image and digest")
    for shape in sorted(equivalent.SHAPES):
        for variant in sorted(equivalent.VARIANTS):
            ef = equivalent.one(equivalent.shape_docs(shape, variant, out)["envoyfilter.yaml"], "EnvoyFilter")
            (ec,) = patches(ef, "EXTENSION_CONFIG")
            remote = ec["patch"]["value"]["typed_config"]["config"]["vm_config"]["code"]["remote"]
            expect(remote["http_uri"]["uri"] == f"oci://{image}" and remote["sha256"] == hexdigest,
                   f"--manifests {variant} {shape}: the EnvoyFilter pulls oci://{image} with the manifest digest")
    print("schemas (--manifests):")
    validate_schemas(crds, {p: equivalent.load_docs(p) for p in written})
    print("names (--manifests):")
    for shape in sorted(equivalent.SHAPES):
        singleton_references(shape, equivalent.shape_docs(shape, "singleton", out), equivalent.shape_docs(shape, "lease", out), ref)
    try:
        build_oci.write_manifests("oci://" + image, manifest_digest, os.path.join(out, "bad"))
        problem("--manifests accepted an image with an oci:// scheme")
    except ValueError:
        ok("--manifests refuses an image given with a scheme")


# ---------------------------------------------------------------- Envoy


def envoy_checks(wasm):
    print("envoy:")
    envoy = shutil.which("envoy")
    if not envoy or not os.path.exists(wasm):
        problem(f"envoy ({envoy}) or the module ({wasm}) is missing; build the module, or pass --no-envoy")
        return
    with tempfile.TemporaryDirectory() as d:
        try:
            certs = equivalent.make_mesh_certs(os.path.join(d, "certs"))
        except (OSError, subprocess.CalledProcessError) as e:
            problem(f"openssl could not make the STRICT stand-in's certificates: {e}")
            certs = None
        # Model servers without sidecars (the transport_socket removed) and
        # Istio STRICT (the shipped mTLS, its secrets from files).
        meshes = [("no sidecars", None)] + ([("STRICT", certs)] if certs else [])
        for variant in sorted(equivalent.VARIANTS):
            for shape in sorted(equivalent.SHAPES):
                for mesh, mesh_certs in meshes:
                    cfg = equivalent.build(shape, os.path.join(d, variant, shape, mesh.replace(" ", "-")), wasm,
                                           ["127.0.0.1:1", "127.0.0.1:2"], 1, 2, variant, mesh_certs=mesh_certs)
                    p = subprocess.run([envoy, "--mode", "validate", "-c", cfg["config"], "--use-dynamic-base-id"],
                                       capture_output=True, text=True, timeout=120)
                    expect(p.returncode == 0, f"{variant} {shape} ({mesh}): envoy --mode validate on the equivalent bootstrap")
        # A real start of each variant: ECDS accepted, the added clusters over
        # CDS, the plugin configs loaded (validate mode does not run the
        # module's configure nor read CDS); and of the STRICT stand-in, where
        # the collector's clusters carry the mTLS.
        for variant in sorted(equivalent.VARIANTS):
            real_start(envoy, wasm, os.path.join(d, f"run-{variant}"), variant)
        if certs:
            real_start(envoy, wasm, os.path.join(d, "run-strict"), "lease", certs)


def real_start(envoy, wasm, workdir, variant, mesh_certs=None):
    import socket

    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s)
    port, admin = (s.getsockname()[1] for s in ports)
    for s in ports:
        s.close()
    cfg = equivalent.build("sidecar", workdir, wasm, ["127.0.0.1:1"], port, admin, variant, mesh_certs=mesh_certs)
    name = variant + (" STRICT" if mesh_certs else "")
    log = open(os.path.join(workdir, "envoy.log"), "w+")
    proc = subprocess.Popen([envoy, "-c", cfg["config"], "--use-dynamic-base-id", "--concurrency", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    def get(path):
        return urllib.request.urlopen(f"http://127.0.0.1:{admin}{path}", timeout=2).read().decode()

    try:
        stats = clusters = cds = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                stats = get("/stats?filter=extension_config_discovery")
                if "kvroute.config_reload: 1" in stats:
                    clusters = get("/clusters")
                    cds = get("/stats?filter=cluster_manager.cds.update")
                    break
            except OSError:
                pass
            time.sleep(0.2)
        time.sleep(1)
        log.seek(0)
        text = log.read()
        expect("kvroute.config_reload: 1" in stats and "config_fail: 0" in stats, f"{name}: a real Envoy accepted the filter over ECDS")
        added = cfg["added_clusters"]
        expect(all(f"{c}::" in clusters for c in added) and "update_rejected: 0" in cds,
               f"{name}: {', '.join(added)} came over CDS, none rejected")
        expect("invalid kvroute config" not in text and proc.poll() is None,
               f"{name}: the plugin JSON loads" + (" in the filter and the collector" if variant == "singleton" else ""))
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
        log.close()


def note_shared_schemas(crd_file):
    """Says so when the project's shared copy of the schemas (../shared/istio,
    beside the clone) differs from the one checked against: a newer Istio
    to copy into testdata/istio."""
    shared = os.path.join(os.path.dirname(REPO), "shared", "istio", "customresourcedefinitions.gen.yaml")
    if not os.path.exists(shared) or os.path.abspath(shared) == os.path.abspath(crd_file):
        return
    with open(shared, "rb") as a, open(crd_file, "rb") as b:
        if a.read() != b.read():
            print(f"note: {shared} differs from {crd_file}; checking against the latter "
                  "(copy the shared file into testdata/istio/ to move to it)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = os.environ.get("KVROUTE_ISTIO_SCHEMAS") or os.path.join(REPO, "testdata", "istio")
    ap.add_argument("--schemas", default=default, help=f"directory of customresourcedefinitions.gen.yaml (default {default})")
    ap.add_argument("--wasm", default=os.environ.get("KVROUTE_WASM") or render.DEFAULT_WASM)
    ap.add_argument("--no-envoy", action="store_true", help="skip the Envoy checks")
    a = ap.parse_args()
    crd_file = os.path.join(a.schemas, "customresourcedefinitions.gen.yaml")
    if not os.path.exists(crd_file):
        print(f"istio/check.py: {crd_file} not found; set KVROUTE_ISTIO_SCHEMAS or --schemas", file=sys.stderr)
        return 2
    note_shared_schemas(crd_file)
    crds = load_crds(crd_file)
    manifests = {}
    for variant, root in sorted(equivalent.VARIANTS.items()):
        for shape in sorted(equivalent.SHAPES):
            d = os.path.join(root, shape)
            for name in sorted(os.listdir(d)):
                if name.endswith(".yaml"):
                    manifests[os.path.join(d, name)] = equivalent.load_docs(os.path.join(d, name))
    validate_schemas(crds, manifests)
    ref = rendered()
    for shape in sorted(equivalent.SHAPES):
        cross_references(shape, equivalent.shape_docs(shape), ref)
        singleton_references(shape, equivalent.shape_docs(shape, "singleton"), equivalent.shape_docs(shape), ref)
    check_oci(crds, ref)
    if not a.no_envoy:
        envoy_checks(a.wasm)
    print(f"istio/check.py: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
