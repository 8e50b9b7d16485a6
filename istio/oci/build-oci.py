#!/usr/bin/env python3
"""Build an OCI image layout holding kvroute_wasm.wasm, without Docker.

    python3 istio/oci/build-oci.py [--wasm PATH] [--out DIR] [--tag 0.1.0]
        [--image REGISTRY/REPO:TAG --manifests DIR]

The image is the "compat" variant of the Wasm image specification that Istio's
agent reads (pkg/wasm/imagefetcher.go, extractOCIStandardImage): an OCI image
manifest whose last layer is `application/vnd.oci.image.layer.v1.tar+gzip`
and contains `plugin.wasm`. The same image also mounts as a Kubernetes image
volume (the collector reads /var/lib/kvroute/plugin.wasm from it).

The build is reproducible: fixed file mode, owner and time, gzip without a
timestamp, so the same module always gives the same manifest digest.

It prints the manifest digest. Use that hex digest as `sha256` next to an
`oci://` URL (the agent compares it with the manifest digest, not with the
.wasm's own sha256). With --image and --manifests it also writes istio/'s
manifests (both shapes, both collector variants) into DIR with the image
reference and that digest filled in, ready for `kubectl apply`; the shipped
ones carry a placeholder image and a sha256 of zeros. Push the layout to that
image with any OCI client, for example:

    oras cp --from-oci-layout DIR:TAG REGISTRY/kvroute/kvroute-wasm:TAG
    skopeo copy oci:DIR:TAG docker://REGISTRY/kvroute/kvroute-wasm:TAG
    crane push DIR REGISTRY/kvroute/kvroute-wasm:TAG

Standard library only.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_WASM = os.path.join(REPO, "target", "wasm32-wasip1", "release", "kvroute_wasm.wasm")
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


def _blob(out, data):
    digest = hashlib.sha256(data).hexdigest()
    d = os.path.join(out, "blobs", "sha256")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, digest), "wb") as f:
        f.write(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def layer_tar(wasm_bytes):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("plugin.wasm")
        info.size = len(wasm_bytes)
        info.mode = 0o444
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(wasm_bytes))
    return buf.getvalue()


def build(wasm, out, tag):
    with open(wasm, "rb") as f:
        wasm_bytes = f.read()
    if wasm_bytes[:4] != b"\0asm":
        raise ValueError(f"{wasm} is not a WebAssembly module")
    tar = layer_tar(wasm_bytes)
    gz = gzip.compress(tar, compresslevel=9, mtime=0)
    os.makedirs(out, exist_ok=True)
    layer = dict(mediaType=LAYER, **_blob(out, gz))
    config = {
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(tar).hexdigest()}"]},
    }
    config_desc = dict(mediaType=CONFIG, **_blob(out, json.dumps(config, sort_keys=True).encode()))
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": config_desc,
        "layers": [layer],
        "annotations": {
            "org.opencontainers.image.title": "kvroute",
            "org.opencontainers.image.description": "kvroute proxy-wasm module (plugin.wasm)",
        },
    }
    manifest_desc = dict(mediaType=MANIFEST, **_blob(out, json.dumps(manifest, sort_keys=True).encode()))
    manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": tag}
    with open(os.path.join(out, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "mediaType": INDEX, "manifests": [manifest_desc]}, f, sort_keys=True)
    return {
        "manifest_digest": manifest_desc["digest"],
        "wasm_sha256": hashlib.sha256(wasm_bytes).hexdigest(),
        "layout": os.path.abspath(out),
        "tag": tag,
    }


# What istio/'s shipped manifests hold in place of a real image and digest.
SHIPPED_IMAGE = "registry.example.com/kvroute/kvroute-wasm:0.1.0"
PLACEHOLDER_SHA256 = "0" * 64
# istio/ subdirectories with manifests, and what each file must carry: the
# EnvoyFilters pull the module (image and digest); the singleton variant's
# pod patches mount the same image (image only).
MANIFEST_DIRS = ("gateway", "sidecar", os.path.join("singleton", "gateway"), os.path.join("singleton", "sidecar"))
IMAGE_REF = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+"
                       r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})")


def image_problem(image):
    """Why `image` is not a registry reference --image takes, or None."""
    if IMAGE_REF.fullmatch(image):
        return None
    return (f"--image {image!r} is not a registry reference like registry.io/kvroute/kvroute-wasm:0.1.0 "
            "(no oci:// scheme; a tag or @sha256: digest)")


def write_manifests(image, manifest_digest, out, istio_dir=None):
    """Copy every .yaml of istio/'s MANIFEST_DIRS into out/ (same layout)
    with the placeholder image replaced by `image` (a registry reference
    without a scheme, as pushed) and the placeholder sha256 by the manifest
    digest's hex. Returns the files written. Refuses a malformed reference,
    and a shipped EnvoyFilter without exactly one placeholder of each kind
    (the substitution must not silently miss one)."""
    if image_problem(image):
        raise ValueError(image_problem(image))
    algo, _, hexdigest = manifest_digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise ValueError(f"manifest digest {manifest_digest!r} is not sha256:<64 hex digits>")
    istio_dir = istio_dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    written = []
    for rel in MANIFEST_DIRS:
        src_dir = os.path.join(istio_dir, rel)
        for name in sorted(os.listdir(src_dir)):
            if not name.endswith(".yaml"):
                continue
            with open(os.path.join(src_dir, name)) as f:
                text = f.read()
            images, shas = text.count(SHIPPED_IMAGE), text.count(PLACEHOLDER_SHA256)
            if name == "envoyfilter.yaml" and (images, shas) != (1, 1):
                raise ValueError(f"{rel}/{name}: expected one placeholder image and one placeholder sha256, "
                                 f"found {images} and {shas}")
            text = text.replace(SHIPPED_IMAGE, image).replace(PLACEHOLDER_SHA256, hexdigest)
            os.makedirs(os.path.join(out, rel), exist_ok=True)
            dst = os.path.join(out, rel, name)
            with open(dst, "w") as f:
                f.write(text)
            written.append(dst)
    return written


def read_plugin(layout, tag=None):
    """Read plugin.wasm back the way Istio's agent does: the index's manifest
    (by tag), its last layer must be tar+gzip, the file named plugin.wasm.
    Every blob's digest is checked."""

    def blob(desc):
        with open(os.path.join(layout, "blobs", *desc["digest"].split(":", 1)), "rb") as f:
            data = f.read()
        assert f"sha256:{hashlib.sha256(data).hexdigest()}" == desc["digest"], desc
        assert len(data) == desc["size"], desc
        return data

    with open(os.path.join(layout, "index.json")) as f:
        index = json.load(f)
    descs = [m for m in index["manifests"]
             if tag is None or m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
    assert len(descs) == 1, descs
    manifest = json.loads(blob(descs[0]))
    assert manifest["mediaType"] == MANIFEST and manifest["config"]["mediaType"] == CONFIG
    last = manifest["layers"][-1]
    assert last["mediaType"] == LAYER, last
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(last))), mode="r:") as tar:
        for m in tar.getmembers():
            if os.path.basename(m.name) == "plugin.wasm":
                return tar.extractfile(m).read(), descs[0]["digest"]
    raise AssertionError("plugin.wasm not found in the last layer")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wasm", default=DEFAULT_WASM)
    p.add_argument("--out", default=os.path.join(REPO, "target", "oci", "kvroute-wasm"))
    p.add_argument("--tag", default="0.1.0")
    p.add_argument("--image", help="where the layout will be pushed, e.g. registry.io/kvroute/kvroute-wasm:0.1.0 "
                   "(with --manifests)")
    p.add_argument("--manifests", metavar="DIR", help="write istio/'s manifests here with --image and the digest")
    a = p.parse_args(argv)
    if bool(a.image) != bool(a.manifests):
        p.error("--image and --manifests go together")
    if a.image and image_problem(a.image):
        p.error(image_problem(a.image))
    if not os.path.exists(a.wasm):
        print(f"build-oci.py: {a.wasm} is missing; build it with\n"
              "  cargo build --release --target wasm32-wasip1 -p kvroute-wasm", file=sys.stderr)
        return 2
    info = build(a.wasm, a.out, a.tag)
    if a.manifests:
        try:
            info["manifests"] = write_manifests(a.image, info["manifest_digest"], a.manifests)
        except ValueError as e:
            print(f"build-oci.py: {e}", file=sys.stderr)
            return 2
        info["image"] = a.image
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
