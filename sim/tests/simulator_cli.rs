//! The two simulator binaries end to end: `--help`, a run, a sweep with its
//! plot, and a what-if verdict on the head of the sample trace.

use std::process::Command;

fn run(bin: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin).args(args).output().expect("binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const SIM: &str = env!("CARGO_BIN_EXE_kvroute-simulate");
const WHATIF: &str = env!("CARGO_BIN_EXE_kvroute-what-if");

#[test]
fn simulate_help_run_sweep_and_plot() {
    let (ok, out, _) = run(SIM, &["--help"]);
    assert!(
        ok && out.contains("--sweep") && out.contains("--num-gpu-blocks"),
        "{out}"
    );
    let small = [
        "--workload",
        "shared-prefix",
        "--groups",
        "6",
        "--system-tokens",
        "1024",
        "--question-tokens",
        "128",
        "--output-tokens",
        "16",
        "--endpoints",
        "3",
    ];
    let mut args = small.to_vec();
    args.extend(["--stages", "rate:4@30s"]);
    let (ok, out, err) = run(SIM, &args);
    assert!(ok, "{err}");
    assert!(
        out.contains("rate 4/s 30s") && out.contains("0 dropped"),
        "{out}"
    );
    let dir = std::env::temp_dir().join(format!("kvroute-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("tau.svg");
    let mut args = small.to_vec();
    let svg_s = svg.to_string_lossy().into_owned();
    args.extend([
        "--stages",
        "rate:4@30s",
        "--sweep",
        "tau=0,500",
        "--plot",
        &svg_s,
    ]);
    let (ok, out, err) = run(SIM, &args);
    assert!(ok, "{err}");
    assert_eq!(
        out.lines()
            .filter(|l| l.starts_with("| 0 |") || l.starts_with("| 500 |"))
            .count(),
        2,
        "{out}"
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.matches("<circle").count() == 4,
        "{plot}"
    );
    // A bad document is refused with the filter's own message.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"plugins": [{"type": "no-such-plugin"}]}"#).unwrap();
    let (ok, _, err) = run(
        SIM,
        &[
            "--workload",
            "reasoning",
            "--config",
            &bad.to_string_lossy(),
        ],
    );
    assert!(!ok && err.contains("plugin configuration"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_if_gives_a_verdict_on_the_sample_trace() {
    let (ok, out, _) = run(WHATIF, &["--help"]);
    assert!(ok && out.contains("--trace"), "{out}");
    // The head of the sample trace keeps the test fast.
    let full = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/traces/support-chat.jsonl"
    ))
    .unwrap();
    let head: String = full.lines().take(200).map(|l| format!("{l}\n")).collect();
    let path = std::env::temp_dir().join(format!("kvroute-whatif-{}.jsonl", std::process::id()));
    std::fs::write(&path, head).unwrap();
    let (ok, out, err) = run(
        WHATIF,
        &[
            "--trace",
            &path.to_string_lossy(),
            "--num-gpu-blocks",
            "2048",
            "--peak",
            "19692",
        ],
    );
    let _ = std::fs::remove_file(&path);
    assert!(ok, "{err}");
    for want in [
        "**Verdict:",
        "distinguishing prefixes span whole blocks",
        "the working set exceeds one endpoint's cache",
        "reuse ceiling",
        "| round robin |",
        "| shipped default |",
        "| always-sticky |",
        "## Bottleneck",
        "Recommended τ",
        "Cost of getting it wrong",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
}
