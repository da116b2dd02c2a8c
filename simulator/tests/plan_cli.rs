//! `kvroute-sim plan` as a user runs it: errors that say what to write, and a small plan
//! end to end with its table, chart, JSON and SVG.

#![allow(clippy::unwrap_used)] // test helpers

use std::process::{Command, Output};

fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .arg("plan")
        .args(args)
        .output()
        .unwrap()
}

const SMALL: [&str; 8] = [
    "--workload",
    "shared-prefix",
    "--groups",
    "8",
    "--per-group",
    "8",
    "--rate",
    "40",
];

#[test]
fn bad_plan_arguments_fail_with_a_message_that_says_what_to_write() {
    let cold_s = |s: &'static str| vec!["--objective", "ttft_p95=500ms", "--price", "h100-80g=2", "--cold-s", s];
    for (extra, says) in [
        (
            vec!["--objective", "ttft_p95=500", "--price", "h100-80g=2"],
            "has no unit",
        ),
        (
            vec!["--objective", "ttft=500ms", "--price", "h100-80g=2"],
            "unknown objective",
        ),
        (
            vec!["--objective", "ttft_p95=500ms", "--price", "h200=2"],
            "unknown GPU \"h200\"",
        ),
        (
            vec![
                "--objective",
                "ttft_p95=500ms",
                "--gpu",
                "h100-80g,a100-80g",
                "--price",
                "h100-80g=2",
            ],
            "no price for a100-80g",
        ),
        (
            vec![
                "--objective",
                "ttft_p95=500ms",
                "--price",
                "h100-80g=2",
                "--max-servers",
                "0",
            ],
            "--max-servers must be at least 1",
        ),
        (cold_s("0"), "--cold-s must be a positive number of seconds"),
        (cold_s("60"), "--cold-s 60 leaves no steady state"),
    ] {
        let out = plan(&[&SMALL[..], &extra].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
}

#[test]
fn a_small_plan_prints_a_size_per_policy_and_writes_json_and_svg() {
    let dir = std::env::temp_dir().join(format!("kvroute-plan-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("plan.json"), dir.join("plan.svg"));
    let out = plan(
        &[
            &SMALL[..],
            &[
                "--objective",
                "ttft_p95=300ms",
                "--price",
                "h100-80g=2.49",
                "--policy",
                "round-robin,kvroute",
                "--max-servers",
                "4",
                "--json",
                json.to_str().unwrap(),
                "--plot",
                svg.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for policy in ["round-robin", "kvroute"] {
        let row = stdout.lines().find(|l| l.starts_with(policy)).unwrap();
        assert!(row.contains("h100-80g"), "{row}");
    }
    assert!(stdout.contains("Share of requests within the objective"), "{stdout}");
    assert!(stdout.contains("over the whole run (cold start included)"), "{stdout}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let sizings = doc["sizings"].as_array().unwrap();
    assert_eq!(sizings.len(), 2);
    for s in sizings {
        assert!(!s["points"].as_array().unwrap().is_empty());
        if !s["servers"].is_null() {
            assert!(s["cost"]["usd_per_month"].as_f64().unwrap() > 0.0);
        }
    }
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_mixes_fail_with_a_message_that_says_what_to_write() {
    let dir = std::env::temp_dir().join(format!("kvroute-plan-mix-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let priority = dir.join("priority.json");
    std::fs::write(&priority, r#"{"tiers": {"from_priority": true}}"#).unwrap();
    let both = "a100-80g=1.3,h100-80g=3";
    for (extra, says) in [
        (vec!["--mix", "a100-80g", "--price", both], "two GPU types"),
        (
            vec!["--mix", "h100-80g,h100-80g", "--price", both],
            "two different GPU types",
        ),
        (
            vec!["--mix", "a100-80g,h100-80g", "--price", "a100-80g=1"],
            "no price for h100-80g",
        ),
        (
            vec!["--mix", "a100-80g,h100-80g", "--gpu", "h100-80g", "--price", both],
            "cannot be used with",
        ),
        (vec!["--tiered", "--price", both], "--mix"),
        (
            vec![
                "--mix",
                "a100-80g,h100-80g",
                "--tiered",
                "--price",
                both,
                "--router-config",
                priority.to_str().unwrap(),
            ],
            "drop `tiers.from_priority`",
        ),
        (
            vec!["--mix", "a100-80g,h100-80g", "--price", both, "--plot", "x.svg"],
            "--plot",
        ),
    ] {
        let out = plan(&[&SMALL[..], &["--objective", "ttft_p95=500ms"], &extra[..]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_mixed_plan_prints_each_policys_staircase_and_its_cheapest_fleet() {
    let dir = std::env::temp_dir().join(format!("kvroute-plan-mix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("mix.json");
    let out = plan(
        &[
            &SMALL[..],
            &[
                "--objective",
                "ttft_p95=300ms",
                "--mix",
                "a100-80g,h100-80g",
                "--tiered",
                "--price",
                "a100-80g=1.30,h100-80g=3.00",
                "--policy",
                "kvroute",
                "--max-servers",
                "4",
                "--max-cheap",
                "4",
                "--cold-s",
                "0.5",
                "--json",
                json.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("kvroute:\n") && stdout.contains("kvroute+tiers:\n"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("← cheapest").count(), 2, "{stdout}");
    assert!(
        stdout.contains("in steady state (requests arriving after 0.5 s)"),
        "{stdout}"
    );
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["mix"], serde_json::json!(["a100-80g", "h100-80g"]));
    assert_eq!(doc["cold_s"], 0.5);
    for s in doc["sizings"].as_array().unwrap() {
        let rows = s["rows"].as_array().unwrap();
        let best = &rows[s["cheapest"].as_u64().unwrap() as usize];
        let per_hour = |r: &serde_json::Value| r["usd_per_hour"].as_f64().unwrap();
        assert!(rows.iter().all(|r| per_hour(r) >= per_hour(best)), "{s}");
        // Every row is a fleet that was replayed and met the objective.
        let evaluated = s["evaluated"].as_array().unwrap();
        for r in rows {
            let e = evaluated
                .iter()
                .find(|e| e[0] == r["cheap"] && e[1] == r["premium"])
                .unwrap();
            assert_eq!(e[2]["meets"], true, "{r}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
