//! Test 6: a bad plugin config makes on_configure return false with a log
//! line naming the field; the VM stays usable with a good config.

use crate::support::*;
use kvroute_harness::artifacts::kvroute_wasm;
use kvroute_harness::{Cluster, VmSpec};

#[test]
fn bad_config_is_rejected_with_the_field_named_and_the_vm_recovers() {
    let wasm = kvroute_wasm().expect("kvroute module");
    let cases = [
        (
            config(
                serde_json::json!({"plugins": [{"type": "prefix-cache-affinity-filter", "parameters": {"affinityThreshold": 1.5}}]}),
            ),
            "plugins[0].parameters.affinityThreshold",
        ),
        (
            config(serde_json::json!({"routing": {"maxFallbacks": 99}})),
            "routing.maxFallbacks",
        ),
        (
            config(serde_json::json!({"routing": {"noSuchField": 1}})),
            "routing.noSuchField",
        ),
        (r#"{"routing": {}}"#.to_string(), "endpoints"),
        ("not json at all".to_string(), "config"),
    ];
    for (root_id, name) in [("kvroute", "worker"), ("kvroute-collector", "collector")] {
        for (bad, field) in &cases {
            let c = Cluster::new();
            let started = c
                .add_vm(VmSpec::new(name, &wasm, VM_ID, root_id, bad))
                .unwrap();
            assert!(!started.configured, "{root_id}: accepted {bad}");
            let lines = c.logs_matching(field);
            assert!(
                !lines.is_empty(),
                "{root_id}: no log line names `{field}` for {bad}"
            );
            assert!(c.vm_failure(0).is_none());
            assert!(
                c.configure(0, config(serde_json::json!({})).as_bytes())
                    .unwrap(),
                "{root_id}: good config refused after a bad one"
            );
            if root_id == "kvroute" {
                let req = c
                    .post(0, "/v1/completions", &completion("after recovery", false))
                    .unwrap();
                assert!(primary(&c, req).is_some(), "not routing after recovery");
            }
        }
    }
}
