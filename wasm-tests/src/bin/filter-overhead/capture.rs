//! `capture [N]` and `capture-pair [N]`: what traffic capture costs: the filter writing one
//! line a request, and the shipped access log writing it out. `capture` compares a fresh
//! Envoy per run; those move by ±20 µs a request from one Envoy to the next, so
//! `capture-pair` runs capture off and capture on as two listeners of one Envoy, each in its
//! own VM, and also reads the time the capture code takes inside the VM.

use std::time::Duration;

use kvroute_wasm_tests::envoy::{repo_root, Envoy};

use crate::wrk::{one_kib_bench, wrk_path, WrkResult};

/// `capture`: what traffic capture costs. Envoy CPU per request on the kvroute listener
/// (1 KiB, 8 connections, wrk 4 s after 2 s of warm-up, a fresh Envoy each run, `rounds` times in the order
/// off / filter only / with the access log, then back), capture sampling every request:
/// the filter's part (ids, the line, one host call) alone, then with the shipped access
/// log writing it. Medians and ranges: one run moves by more than the effect.
pub fn capture(rounds: usize) -> Result<(), String> {
    let (_servers, ports, dir, script) = one_kib_bench("capture")?;
    let log = dir.join("capture.jsonl");
    let after = "\"policy\": \"cost\"";
    let on = "\"sample\": 1.0, \"salt\": \"bench-capture-salt-0123\"";
    let mut runs: [Vec<WrkResult>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let mut lines = 0;
    for side in [0usize, 1, 2, 2, 1, 0].repeat(rounds.max(1)) {
        let _ = std::fs::remove_file(&log);
        let edit = |t: String| match side {
            0 => t,
            // The filter writes the line; no access log reads it.
            1 => t.replacen(after, &format!("{after}, \"capture\": {{{on}}}"), 1),
            _ => kvroute_wasm_tests::envoy::with_capture(&t, &log, after, on),
        };
        let envoy = Envoy::start("bench-overhead.yaml", &ports, edit)?;
        std::thread::sleep(Duration::from_millis(600));
        // A fresh V8 first runs the module's baseline code and compiles the optimised
        // tier in the background, on Envoy's CPU time: warm it before measuring.
        wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 2)?;
        runs[side].push(wrk_path(&envoy, envoy.port, "/v1/chat/completions", &script, 8, 4)?);
        if side == 2 {
            drop(envoy);
            lines += std::fs::read_to_string(&log).map(|t| t.lines().count()).unwrap_or(0);
        }
    }
    let stats = |side: usize, f: fn(&WrkResult) -> f64| {
        let mut v: Vec<f64> = runs[side].iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    // Added CPU: each run against the capture-off run of the same round and half.
    let added = |side: usize| {
        let mut v: Vec<f64> = runs[side]
            .iter()
            .zip(&runs[0])
            .map(|(with, off)| with.envoy_cpu_us - off.envoy_cpu_us)
            .collect();
        v.sort_by(f64::total_cmp);
        format!("{:+.1} µs [{:+.1} to {:+.1}]", v[v.len() / 2], v[0], v[v.len() - 1])
    };
    println!("{} runs per side; medians [min–max]\n", runs[0].len());
    println!("| 1 KiB, 8 connections, sampling 100% | Envoy CPU/req | added (paired with capture off) | req/s |");
    println!("|---|---|---|---|");
    let labels = [
        "capture off",
        "filter writes the line (no access log)",
        "filter + the shipped access log",
    ];
    for (side, label) in labels.iter().enumerate() {
        let (cpu, lo, hi) = stats(side, |r| r.envoy_cpu_us);
        let (rps, _, _) = stats(side, |r| r.rps);
        let add = if side == 0 { String::new() } else { added(side) };
        println!("| {label} | {cpu:.1} µs [{lo:.1}–{hi:.1}] | {add} | {rps:.0} |");
    }
    println!("\nlines written by the access log over its two runs: {lines}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The bench config with its empty-filter listener replaced by a second kvroute listener
/// (its own VM, `vm_id: kvroute_capture`) that captures every request and writes the
/// shipped access log to `log`.
fn capture_listener(text: String, log: &std::path::Path) -> String {
    let cut = |from: &str, to: &str| -> Option<(usize, usize)> {
        let a = text.find(from)?;
        Some((a, a + text[a..].find(to)?))
    };
    let (Some((k0, k1)), Some((e0, e1)), Some((j0, j1))) = (
        cut("    - name: inference\n", "    - name: inference_no_filter\n"),
        cut("    - name: inference_empty_filter\n", "  clusters:"),
        cut("value: &kvroute_config |\n", "\nstatic_resources"),
    ) else {
        return text;
    };
    let json: String = text[j0..j1]
        .lines()
        .skip(1)
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
        .replacen(
            "\"policy\": \"cost\",",
            "\"policy\": \"cost\", \"capture\": {\"sample\": 1.0, \"salt\": \"bench-capture-salt-0123\"},",
            1,
        );
    let port_line = text[e0..e1]
        .lines()
        .find(|l| l.contains("port_value"))
        .unwrap_or_default();
    let kvroute = &text[k0..k1];
    let own_port = kvroute.lines().find(|l| l.contains("port_value")).unwrap_or_default();
    let capture = kvroute
        .replacen("    - name: inference\n", "    - name: inference_capture\n", 1)
        .replacen(own_port, port_line, 1)
        .replacen(
            "                stat_prefix: inference\n",
            &format!(
                "                stat_prefix: inference_capture\n{}",
                kvroute_wasm_tests::envoy::capture_log(log)
            ),
            1,
        )
        .replacen("name: kvroute\n", "name: kvroute_capture\n", 1)
        .replacen("vm_id: kvroute\n", "vm_id: kvroute_capture\n", 1)
        .replacen("dist/kvroute.wasm", "dist/kvroute-self-timing.wasm", 1)
        .replacen("value: *kvroute_config", &format!("value: '{json}'"), 1);
    format!("{}{}{}", &text[..e0], capture, &text[e1..])
}

/// `capture-pair`: capture's cost in one Envoy, one VM per side: the kvroute listener
/// without capture and a second kvroute listener (its own VM, the `self-timing` build,
/// which also reports the time its capture code takes) capturing every request through
/// the shipped access log, wrk 4 s on each in turn (A B B A, `rounds` times,
/// after 4 s of warm-up on each), 1 KiB, 8 connections. No fresh process per run: the
/// fresh-Envoy runs of `capture` move by ±20 µs a request from one Envoy to the next.
pub fn capture_pair(rounds: usize) -> Result<(), String> {
    if !repo_root().join("dist/kvroute-self-timing.wasm").exists() {
        return Err("no dist/kvroute-self-timing.wasm: run `make build-wasm-self-timing`".into());
    }
    let (_servers, ports, dir, script) = one_kib_bench("capture-pair")?;
    let log = dir.join("capture.jsonl");
    let envoy = Envoy::start("bench-overhead.yaml", &ports, |t| capture_listener(t, &log))?;
    std::thread::sleep(Duration::from_millis(1500));
    let sides = [envoy.port, envoy.port3];
    for port in sides {
        wrk_path(&envoy, port, "/v1/chat/completions", &script, 8, 4)?;
    }
    let mut runs: [Vec<WrkResult>; 2] = [Vec::new(), Vec::new()];
    for side in [0usize, 1, 1, 0].repeat(rounds.max(1)) {
        runs[side].push(wrk_path(&envoy, sides[side], "/v1/chat/completions", &script, 8, 4)?);
    }
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let cpu = |side: usize| sorted(runs[side].iter().map(|r| r.envoy_cpu_us).collect());
    let added = sorted(
        runs[1]
            .iter()
            .zip(&runs[0])
            .map(|(on, off)| on.envoy_cpu_us - off.envoy_cpu_us)
            .collect(),
    );
    let mid = |v: &[f64]| v[v.len() / 2];
    println!("{} runs per side in one Envoy; medians [min–max]\n", runs[0].len());
    println!(
        "| 1 KiB, 8 connections | Envoy CPU/req, capture off | capture 100% + access log | added (paired) | errors |"
    );
    println!("|---|---|---|---|---|");
    let (off, on) = (cpu(0), cpu(1));
    println!(
        "| same process | {:.1} µs [{:.1}–{:.1}] | {:.1} µs [{:.1}–{:.1}] | {:+.1} µs [{:+.1} to {:+.1}] | {} |",
        mid(&off),
        off[0],
        off[off.len() - 1],
        mid(&on),
        on[0],
        on[on.len() - 1],
        mid(&added),
        added[0],
        added[added.len() - 1],
        runs.iter().flatten().any(|r| r.errors)
    );
    let captured = envoy.stat("wasmcustom.kvroute.capture.lines");
    // Each timed span includes one host clock read (≈ 0.4 µs here).
    for part in ["request", "line", "set_property"] {
        let ns = envoy.stat(&format!("wasmcustom.kvroute.capture.ns_{part}"));
        println!("in the VM, {part}: {:.0} ns a line", ns as f64 / captured.max(1) as f64);
    }
    drop(envoy);
    let lines = std::fs::read_to_string(&log).map(|t| t.lines().count()).unwrap_or(0);
    println!("\ncapture.lines {captured}, lines in the access log file {lines}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
