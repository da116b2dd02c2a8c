//! `kvroute-sim replay --price` and `matrix` as a user runs them: the cost lines under the
//! latency table, the same figures in the JSON, an error that names the GPU left unpriced,
//! and a matrix refused up front for a workload it does not know.

#![allow(clippy::unwrap_used)] // test helpers

use std::process::{Command, Output};

fn replay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .arg("replay")
        .args([
            "--workload",
            "shared-prefix",
            "--groups",
            "8",
            "--per-group",
            "8",
            "--rate",
            "40",
            "--fleet",
            "1xa100-80g:llama-3.1-8b,2xh100-80g:llama-3.1-8b",
            "--policy",
            "round-robin,kvroute",
        ])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_fleet_left_unpriced_is_refused_with_the_gpu_to_add() {
    let out = replay(&["--price", "h100-80g=3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no price for a100-80g"), "{stderr}");
}

#[test]
fn a_priced_replay_prints_and_writes_each_policys_cost_objective_and_gpu_shares() {
    let json = std::env::temp_dir().join(format!("kvroute-replay-cli-{}.json", std::process::id()));
    let out = replay(&[
        "--price",
        "h100-80g=3,a100-80g=1.5",
        "--ttft-slo-ms",
        "500",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("the fleet 7.50 USD an hour"), "{stdout}");
    assert!(stdout.contains("TTFT ≤ 500 ms"), "{stdout}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let cost = &doc["cost"];
    assert_eq!(cost["fleet_usd_per_hour"], 7.5);
    for (i, c) in cost["runs"].as_array().unwrap().iter().enumerate() {
        let run = &doc["runs"][i];
        assert_eq!(c["policy"], run["policy"]);
        let tokens_per_hour = (run["throughput"]["input_tok_s"].as_f64().unwrap()
            + run["throughput"]["output_tok_s"].as_f64().unwrap())
            * 3600.0;
        let usd = c["usd_per_mtok"].as_f64().unwrap();
        assert!((usd - 7.5 / (tokens_per_hour / 1e6)).abs() < 1e-9, "{c}");
        let shares = &c["share_by_gpu"];
        let (a100, h100) = (
            shares["a100-80g"].as_f64().unwrap(),
            shares["h100-80g"].as_f64().unwrap(),
        );
        assert!((a100 + h100 - 1.0).abs() < 1e-9, "{c}");
        let met = c["objective_met"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&met), "{c}");
        // The policy's line, with its figures as printed.
        let policy = run["policy"].as_str().unwrap();
        let line = stdout
            .lines()
            .find(|l| l.starts_with(policy) && l.contains("a100-80g"))
            .unwrap();
        assert!(line.contains(&format!("{usd:.4}")), "{line}");
        assert!(line.contains(&format!("a100-80g {:.1}%", 100.0 * a100)), "{line}");
    }
    // Round-robin gives the one A100 a third of the requests.
    let rr = &cost["runs"][0]["share_by_gpu"]["a100-80g"];
    assert!((rr.as_f64().unwrap() - 1.0 / 3.0).abs() < 0.02, "{rr}");
}

#[test]
fn records_list_every_completed_request_of_each_run_and_of_each_replica() {
    let dir = std::env::temp_dir();
    let one = dir.join(format!("kvroute-replay-records-{}.json", std::process::id()));
    let out = replay(&["--json", one.to_str().unwrap(), "--records"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&one).unwrap()).unwrap();
    let _ = std::fs::remove_file(&one);
    for run in doc["runs"].as_array().unwrap() {
        let records = run["records"].as_array().unwrap();
        assert_eq!(
            records.len() as u64,
            run["completed"].as_u64().unwrap(),
            "{}",
            run["policy"]
        );
        // Servers as numbered in the fleet (3 of them), TTFTs as the percentiles bound them.
        let max_ttft = records
            .iter()
            .map(|r| r["ttft_ms"].as_f64().unwrap())
            .fold(0.0, f64::max);
        assert!((max_ttft - run["ttft_cdf_ms"].as_array().unwrap().last().unwrap().as_f64().unwrap()).abs() < 1e-6);
        assert!(records.iter().all(|r| r["server"].as_u64().unwrap() < 3));
    }
    // Medians carry none; each replica's run carries its own.
    let many = dir.join(format!("kvroute-replay-records-r-{}.json", std::process::id()));
    let out = replay(&["--json", many.to_str().unwrap(), "--records", "--replicas", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&many).unwrap()).unwrap();
    let _ = std::fs::remove_file(&many);
    assert!(doc["runs"][0].get("records").is_none());
    for policy in doc["replica_runs"].as_array().unwrap() {
        for run in policy.as_array().unwrap() {
            let n = run["records"].as_array().unwrap().len() as u64;
            assert_eq!(n, run["completed"].as_u64().unwrap());
        }
    }
    // Without --json there is nowhere to write them.
    let out = replay(&["--records"]);
    assert!(!out.status.success());
}

#[test]
fn every_replica_keeps_the_classes_and_their_goodput_is_a_median_in_the_json() {
    let json = std::env::temp_dir().join(format!("kvroute-replay-classes-{}.json", std::process::id()));
    let out = replay(&[
        "--tenants",
        "0.5,0.5",
        "--priorities",
        "1:0.5,-1:0.5",
        "--objectives",
        "1:400",
        "--replicas",
        "3",
        "--records",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    for policy in doc["replica_runs"].as_array().unwrap() {
        for run in policy.as_array().unwrap() {
            let records = run["records"].as_array().unwrap();
            let band = |p: i64| records.iter().filter(|r| r["priority"].as_i64() == Some(p)).count();
            assert!(band(1) > 0 && band(-1) > 0, "each replica draws both bands");
            // Band 1 sends its 400 ms objective; band -1 none.
            for r in records {
                let own = r.get("ttft_objective_ms").and_then(|o| o.as_f64());
                assert_eq!(own, (r["priority"].as_i64() == Some(1)).then_some(400.0));
            }
        }
    }
    let classes = doc["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 2, "one entry per policy");
    for c in classes {
        let g = &c["goodput_req_s"];
        let (lo, mid, hi) = (
            g["min"].as_f64().unwrap(),
            g["median"].as_f64().unwrap(),
            g["max"].as_f64().unwrap(),
        );
        assert!(lo <= mid && mid <= hi && mid > 0.0, "{g}");
        let kinds: Vec<&str> = c["by_class"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["class"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, vec!["priority", "priority", "tenant", "tenant"]);
    }
}

#[test]
fn a_matrix_with_an_unknown_workload_is_refused_before_any_replay() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args([
            "matrix",
            "--workloads",
            "shared-prefix,chat",
            "--loads",
            "50",
            "--replicas",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("unknown workload \"chat\""), "{stderr}");
    assert!(stderr.contains("long-chat"), "the valid names are listed: {stderr}");
    // Refused before shared-prefix ran: its capacity line never printed.
    assert!(!stderr.contains("capacity"), "{stderr}");
}

#[test]
fn a_scrape_interval_that_is_not_positive_is_refused_by_every_command() {
    // One flag, one check (`RouterArgs`), in each command that replays.
    let commands: [&[&str]; 3] = [
        &[
            "matrix",
            "--workloads",
            "shared-prefix",
            "--loads",
            "50",
            "--replicas",
            "1",
        ],
        &["replay", "--workload", "shared-prefix", "--policy", "kvroute"],
        &[
            "plan",
            "--workload",
            "shared-prefix",
            "--objective",
            "ttft_p95=500ms",
            "--price",
            "h100-80g=2",
        ],
    ];
    for command in commands {
        for interval in ["0", "-5", "NaN", "inf"] {
            let out = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
                .args(command)
                .arg(format!("--scrape-interval-ms={interval}"))
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            let what = format!("{} {interval}", command[0]);
            assert!(!out.status.success(), "{what}");
            assert!(
                stderr.contains("--scrape-interval-ms must be positive"),
                "{what}: {stderr}"
            );
            assert!(
                !stderr.contains("capacity") && !stderr.contains("p95"),
                "{what}: refused before any replay: {stderr}"
            );
        }
    }
}
