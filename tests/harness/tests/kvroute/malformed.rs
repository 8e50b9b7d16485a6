//! Test 7: the malformed-input corpus through the real module: no trap, and
//! the documented failure mode in both modes. The corpus is the project's
//! `testdata/requests/bad-*.json`, the harness's own
//! `tests/harness/testdata/malformed/`, and a few generated extremes. The
//! good bodies of `testdata/requests/` must route.

use crate::support::*;
use kvroute_harness::Cluster;

/// Files a lenient parser may accept; only "no trap, exact accounting" applies.
const MAY_PARSE: [&str; 6] = [
    // OpenAI allows a message without content (assistant tool calls).
    "content-missing.json",
    "utf8-bom.json",
    "duplicate-keys.json",
    "lone-surrogate.json",
    "mixed-token-ids.json",
    "huge-number.json",
];

fn is_lenient(name: &str) -> bool {
    MAY_PARSE.contains(&name) || name.contains("ignored-field")
}

/// (file name, bytes) of the files in `dir` (relative to the repo) whose
/// names satisfy `keep`, sorted.
fn files_in(dir: &str, keep: impl Fn(&str) -> bool) -> Vec<(String, Vec<u8>)> {
    let dir = kvroute_harness::artifacts::repo_root().join(dir);
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json" || x == "bin"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .filter(|(n, _)| keep(n))
        .map(|(n, p)| (n, std::fs::read(&p).unwrap()))
        .collect();
    files.sort();
    files
}

fn corpus() -> Vec<(String, Vec<u8>)> {
    let mut files = files_in("testdata/requests", |n| n.starts_with("bad-"));
    files.extend(files_in("tests/harness/testdata/malformed", |_| true));
    let deep = format!(
        "{{\"model\":\"m\",\"prompt\":{}1{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    files.push(("generated: 100k-deep nesting".into(), deep.into_bytes()));
    files.push((
        "generated: body over maxBodyBytes".into(),
        completion(&"x".repeat(64 * 1024), false),
    ));
    files.push(("generated: 2000 keys".into(), {
        let mut s = String::from("{\"model\":\"m\",\"prompt\":\"p\"");
        for i in 0..2000 {
            s.push_str(&format!(",\"k{i}\":{i}"));
        }
        s.push('}');
        s.into_bytes()
    }));
    assert!(files.len() >= 40, "corpus too small: {}", files.len());
    files
}

fn run(mode: &str) {
    let cfg = config(
        serde_json::json!({"routing": {"seed": 7, "failureMode": mode, "maxBodyBytes": 16384}}),
    );
    let c: Cluster = fleet(1, &cfg);
    let mut rejected_open = 0;
    for (name, body) in corpus() {
        // Bodies bad only for Anthropic's Messages API go there alone.
        let paths: &[&str] = if name.starts_with("bad-messages-") {
            &["/v1/messages"]
        } else {
            &["/v1/completions", "/v1/chat/completions", "/v1/messages"]
        };
        for &path in paths {
            let req = c
                .post(1, path, &body)
                .unwrap_or_else(|e| panic!("{mode} {name} {path}: {e:#}"));
            let lenient = is_lenient(&name);
            if mode == "open" {
                let up = c.upstream_headers(req);
                assert!(
                    up.is_some(),
                    "{name} {path}: fail-open must forward the request"
                );
                if primary(&c, req).is_none() {
                    rejected_open += 1;
                } else {
                    assert!(lenient, "{name} {path}: routed a malformed body");
                }
                if !c.is_ended(req) {
                    c.respond(req, &[b"{}"]).unwrap();
                }
            } else if !lenient {
                let status = c.downstream_status(req).unwrap_or(0);
                assert!(
                    (400..500).contains(&status),
                    "{name} {path}: fail-closed gave {status}"
                );
                let body = c.stream(req).unwrap().downstream_body;
                let json: serde_json::Value = serde_json::from_slice(&body)
                    .unwrap_or_else(|_| panic!("{name}: error body is not JSON"));
                assert!(
                    json.get("error").is_some(),
                    "{name}: not an OpenAI-style error"
                );
                if path == "/v1/messages" {
                    assert_eq!(
                        json["type"], "error",
                        "{name}: not an Anthropic-style error"
                    );
                    assert!(json["error"]["type"].is_string(), "{name}");
                }
                if name.contains("maxBodyBytes") {
                    assert_eq!(status, 413, "{name}");
                }
            } else if !c.is_ended(req) {
                c.respond(req, &[b"{}"]).unwrap();
            }
            assert!(c.vm_failure(1).is_none(), "{name} {path}: VM failed");
            assert_eq!(
                total_inflight(&c),
                (0, 0),
                "{mode} {name} {path}: charge leaked"
            );
        }
    }
    if mode == "open" {
        assert!(rejected_open > 0);
        assert!(
            stat(&c, "kvroute_fail_open") >= rejected_open as i64,
            "fail-open events not counted"
        );
    }
    // Still healthy afterwards.
    let req = c
        .post(1, "/v1/completions", &completion("a good one", false))
        .unwrap();
    assert!(primary(&c, req).is_some());
}

#[test]
fn malformed_corpus_fail_open() {
    run("open");
}

#[test]
fn malformed_corpus_fail_closed() {
    run("closed");
}

#[test]
fn good_corpus_routes_in_both_modes() {
    let good = files_in("testdata/requests", |n| {
        !n.starts_with("bad-") && !n.starts_with("crash-")
    });
    assert!(good.len() >= 10, "good corpus too small");
    for mode in ["open", "closed"] {
        let cfg = config(serde_json::json!({"routing": {"seed": 7, "failureMode": mode}}));
        let c = fleet(1, &cfg);
        for (name, body) in &good {
            let path = match name.split('-').next().unwrap_or("") {
                "chat" => "/v1/chat/completions",
                "completions" => "/v1/completions",
                "responses" => "/v1/responses",
                "embeddings" => "/v1/embeddings",
                "generate" => "/inference/v1/generate",
                "messages" => "/v1/messages",
                _ => continue,
            };
            let req = c
                .post(1, path, body)
                .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(
                primary(&c, req).is_some(),
                "{mode} {name}: a good body was not routed"
            );
            c.respond(req, &[b"{}"]).unwrap();
            assert_eq!(total_inflight(&c), (0, 0), "{mode} {name}");
        }
    }
}
