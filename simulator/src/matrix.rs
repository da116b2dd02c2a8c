//! The routing-quality matrix: workloads × loads × policies on one fleet, in replay.
//!
//! Load is relative to a measured capacity: the rate at which the fleet starts serving
//! requests when the whole workload arrives at once under `least-request` (a cache-unaware
//! balancer): requests / (time of the last first token). With every arrival at t = 0 the
//! fleet is saturated until it has admitted the last request, so this is its saturated
//! service rate, without the decode tail that the last requests add to the makespan. A load
//! of 80% replays the workload with arrival times scaled to a mean rate of 0.8 × capacity.
//!
//! Each cell runs several replicas: replica 0 is the workload as given, replica k > 0 the
//! same requests with every arrival moved by a seeded uniform jitter of up to half a mean
//! inter-arrival gap either way (and router seed k). Tables show each figure's median over
//! the replicas, so one lucky or unlucky arrival pattern cannot decide a verdict.

use std::fmt::Write;

use crate::policies::PolicyName;
use crate::replay::{run, ReplaySetup, Topology};
use crate::report::RunReport;
use crate::workload::SimRequest;

#[derive(Clone, Debug, serde::Serialize)]
pub struct Cell {
    pub workload: String,
    pub load_pct: u32,
    pub arrival_rate: f64,
    /// The gateway topology every policy ran under (see `replay::topology`).
    pub topology: String,
    /// `replicas[k][i]`: replica k, policy i (the same policy order in every replica).
    pub replicas: Vec<Vec<RunReport>>,
    /// With `--steady-from`: the steady state begins with the arrivals at or after this
    /// time (ms), and `steady` holds each policy's figures for those arrivals alone (medians
    /// over the replicas); the cold start is the rest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steady_after_ms: Option<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub steady: Vec<RunReport>,
}

impl Cell {
    /// Per policy, replica 0's report with every figure the tables and verdicts use
    /// replaced by its median over the replicas.
    pub fn medians(&self) -> Vec<RunReport> {
        let Some(first) = self.replicas.first() else {
            return Vec::new();
        };
        first
            .iter()
            .enumerate()
            .map(|(i, r0)| {
                let runs: Vec<&RunReport> = self.replicas.iter().filter_map(|rep| rep.get(i)).collect();
                let med = |f: &dyn Fn(&RunReport) -> f64| median(runs.iter().map(|r| f(r)).collect());
                let mut m = r0.clone();
                m.ttft_ms.p50 = med(&|r| r.ttft_ms.p50);
                m.ttft_ms.p95 = med(&|r| r.ttft_ms.p95);
                m.ttft_ms.p99 = med(&|r| r.ttft_ms.p99);
                m.throughput.output_tok_s = med(&|r| r.throughput.output_tok_s);
                m.throughput.steady_output_tok_s = med(&|r| r.throughput.steady_output_tok_s);
                m.throughput.req_s = med(&|r| r.throughput.req_s);
                m.prefix_hit_rate = med(&|r| r.prefix_hit_rate);
                m.preemptions = med(&|r| r.preemptions as f64).round() as u64;
                m.evictions = med(&|r| r.evictions as f64).round() as u64;
                m
            })
            .collect()
    }

    /// In how many replicas kvroute's TTFT p95 was the best of the non-oracle policies.
    pub fn kvroute_p95_wins(&self) -> usize {
        self.replicas
            .iter()
            .filter(|runs| {
                let Some(kv) = runs.iter().find(|r| r.policy == "kvroute") else {
                    return false;
                };
                runs.iter()
                    .filter(|r| is_peer(r))
                    .all(|r| kv.ttft_ms.p95 <= r.ttft_ms.p95 * 1.0001)
            })
            .count()
    }
}

/// The median (the mean of the middle two for an even count; 0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Replica `k` of a workload: arrivals jittered by up to ±half a mean gap (seeded by `k`),
/// order restored; replica 0 is the workload unchanged.
pub fn perturbed(requests: &[SimRequest], k: u64) -> Vec<SimRequest> {
    let mut out = requests.to_vec();
    if k == 0 || out.len() < 2 {
        return out;
    }
    let span = out.iter().map(|r| r.arrival_ms).fold(0.0, f64::max);
    let gap = span / out.len() as f64;
    let mut state = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for r in &mut out {
        // splitmix64: a uniform in [0, 1) per request.
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64;
        r.arrival_ms = (r.arrival_ms + (u - 0.5) * gap).max(0.0);
    }
    out.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    out
}

/// Replicas `from..to` of every policy (see the module note), one thread per replica:
/// `out[p][k − from]` is policy `p`'s run on replica `k`.
pub fn replica_runs(
    setup: &ReplaySetup,
    policies: &[PolicyName],
    requests: &[SimRequest],
    from: u64,
    to: u64,
) -> Vec<Vec<RunReport>> {
    let by_replica: Vec<Vec<RunReport>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (from..to)
            .map(|k| {
                scope.spawn(move || {
                    let reqs = perturbed(requests, k);
                    // The classes stay: each copy draws its bands with its own seed.
                    let setup = ReplaySetup {
                        seed: setup.seed.wrapping_add(k),
                        ..setup.clone()
                    };
                    policies.iter().map(|p| run(&setup, *p, &reqs, &|_| {})).collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    (0..policies.len())
        .map(|p| by_replica.iter().filter_map(|runs| runs.get(p).cloned()).collect())
        .collect()
}

/// Requests per second the fleet admits with everything offered at t = 0, behind one router:
/// capacity is the fleet's, so every topology is loaded at the same arrival rate.
pub fn capacity(setup: &ReplaySetup, requests: &[SimRequest]) -> f64 {
    let setup = ReplaySetup {
        classes: None,
        topology: Topology::default(),
        ..setup.clone()
    };
    let burst: Vec<SimRequest> = requests
        .iter()
        .map(|r| SimRequest {
            arrival_ms: 0.0,
            ..r.clone()
        })
        .collect();
    let r = run(&setup, PolicyName::LeastRequest, &burst, &|_| {});
    let last_first_token_s = r.ttft_cdf_ms.last().copied().unwrap_or(0.0) / 1000.0;
    r.completed as f64 / last_first_token_s.max(1e-9)
}

/// The workload re-timed to a mean arrival rate of `rate` requests per second.
pub fn at_rate(requests: &[SimRequest], rate: f64) -> Vec<SimRequest> {
    let span_s = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max) / 1000.0;
    let offered = requests.len() as f64 / span_s.max(1e-9);
    let k = offered / rate;
    requests
        .iter()
        .map(|r| SimRequest {
            arrival_ms: r.arrival_ms * k,
            ..r.clone()
        })
        .collect()
}

/// Per policy, the median over the replicas of its run restricted to the arrivals at or
/// after `after_ms` (`replicas[k][i]`: replica k, policy i).
pub fn steady_medians(replicas: &[Vec<RunReport>], after_ms: f64) -> Vec<RunReport> {
    let policies = replicas.first().map_or(0, Vec::len);
    (0..policies)
        .map(|i| {
            let phases: Vec<RunReport> = replicas
                .iter()
                .filter_map(|rep| rep.get(i))
                .map(|r| r.phase(after_ms, f64::MAX))
                .collect();
            RunReport::median_of(&phases)
        })
        .collect()
}

/// One workload's cells, `replicas` runs of each (in parallel, one thread per replica),
/// `progress` told each finished run. With `steady_from` (a share of each cell's arrival
/// span), each cell also reports the arrivals after that share of its span apart.
#[allow(clippy::too_many_arguments)]
pub fn cells(
    setup: &ReplaySetup,
    name: &str,
    requests: &[SimRequest],
    loads: &[u32],
    policies: &[PolicyName],
    replicas: u64,
    steady_from: Option<f64>,
    progress: &(dyn Fn(&str) + Sync),
) -> anyhow::Result<(f64, Vec<Cell>)> {
    let cap = capacity(setup, requests);
    progress(&format!("{name}: capacity {cap:.2} req/s"));
    let mut out = Vec::new();
    for load in loads {
        let rate = cap * f64::from(*load) / 100.0;
        let base = at_rate(requests, rate);
        crate::replay::check_restart(&setup.topology, &base)
            .map_err(|e| anyhow::anyhow!("{name} at {load}% load: {e}"))?;
        let run_replica = |k: u64| {
            let reqs = perturbed(&base, k);
            let setup = ReplaySetup {
                classes: None,
                seed: setup.seed.wrapping_add(k),
                ..setup.clone()
            };
            let runs: Vec<RunReport> = policies
                .iter()
                .map(|p| {
                    let r = run(&setup, *p, &reqs, &|_| {});
                    progress(&format!("{name} {load}% replica {k} {p}"));
                    r
                })
                .collect();
            (k, runs)
        };
        let mut by_replica: Vec<(u64, Vec<RunReport>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..replicas.max(1))
                .map(|k| scope.spawn(move || run_replica(k)))
                .collect();
            // A replica that panicked must not vanish from the medians: fail the matrix.
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        by_replica.sort_by_key(|(k, _)| *k);
        let replicas: Vec<Vec<RunReport>> = by_replica.into_iter().map(|(_, runs)| runs).collect();
        let span_ms = base.iter().map(|r| r.arrival_ms).fold(0.0, f64::max);
        let steady_after_ms = steady_from.map(|f| f * span_ms);
        out.push(Cell {
            workload: name.to_string(),
            load_pct: *load,
            arrival_rate: rate,
            topology: setup.topology.to_string(),
            steady: steady_after_ms.map_or_else(Vec::new, |at| steady_medians(&replicas, at)),
            steady_after_ms,
            replicas,
        });
    }
    Ok((cap, out))
}

/// The cells as JSON; with `records`, each run also lists every completed request (its
/// server, arrival, TTFT, cached and reachable tokens: what a question about single
/// decisions needs; about 300 MB for the full matrix on 9 replicas, so off by default).
pub fn json(cells: &[Cell], records: bool) -> serde_json::Result<serde_json::Value> {
    let mut doc = serde_json::to_value(cells)?;
    if !records {
        return Ok(doc);
    }
    let runs = cells.iter().zip(doc.as_array_mut().into_iter().flatten());
    for (cell, out) in runs {
        let replicas = cell
            .replicas
            .iter()
            .zip(out["replicas"].as_array_mut().into_iter().flatten());
        for (replica, out) in replicas {
            for (run, out) in replica.iter().zip(out.as_array_mut().into_iter().flatten()) {
                out["records"] = serde_json::to_value(&run.records)?;
            }
        }
    }
    Ok(doc)
}

/// Markdown: per cell, every policy's TTFT p50/p95/p99, throughput and hit rate, and
/// whether kvroute met the goals (p95 and output throughput at least as good as every
/// non-oracle baseline; hit rate within 10% of the oracle's).
pub fn markdown(cells: &[Cell]) -> String {
    let mut s = String::new();
    for c in cells {
        let _ = writeln!(
            s,
            "\n#### {} at {}% load ({:.2} req/s; {}; medians of {} replicas)\n",
            c.workload,
            c.load_pct,
            c.arrival_rate,
            c.topology,
            c.replicas.len()
        );
        let _ = writeln!(
            s,
            "| policy | TTFT p50 | TTFT p95 | TTFT p99 | steady out tok/s | out tok/s incl. drain | prefix hit | evictions | preemptions |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
        for r in &c.medians() {
            let bold = if r.policy == "kvroute" { "**" } else { "" };
            let _ = writeln!(
                s,
                "| {bold}{}{bold} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}% | {} | {} |",
                r.policy,
                r.ttft_ms.p50,
                r.ttft_ms.p95,
                r.ttft_ms.p99,
                r.throughput.steady_output_tok_s,
                r.throughput.output_tok_s,
                r.prefix_hit_rate * 100.0,
                r.evictions,
                r.preemptions
            );
        }
        if let Some(at) = c.steady_after_ms {
            let _ = writeln!(
                s,
                "\nSteady state (arrivals from {:.1} s on; before that, the cold start):\n",
                at / 1000.0
            );
            let _ = writeln!(s, "| policy | TTFT p50 | TTFT p95 | TTFT p99 | prefix hit |");
            let _ = writeln!(s, "|---|---|---|---|---|");
            for r in &c.steady {
                let bold = if r.policy == "kvroute" { "**" } else { "" };
                let _ = writeln!(
                    s,
                    "| {bold}{}{bold} | {:.0} | {:.0} | {:.0} | {:.1}% |",
                    r.policy,
                    r.ttft_ms.p50,
                    r.ttft_ms.p95,
                    r.ttft_ms.p99,
                    r.prefix_hit_rate * 100.0
                );
            }
        }
        let _ = writeln!(s, "\n{}", verdict(c));
    }
    s
}

/// A policy kvroute is compared with: neither kvroute nor the oracle.
fn is_peer(r: &RunReport) -> bool {
    r.policy != "kvroute" && r.policy != "oracle"
}

/// The goals of the routing benchmark, checked for one cell.
pub fn verdict(c: &Cell) -> String {
    let runs = c.medians();
    let Some(kv) = runs.iter().find(|r| r.policy == "kvroute") else {
        return String::new();
    };
    let others: Vec<&RunReport> = runs.iter().filter(|r| is_peer(r)).collect();
    let best_p95 = others.iter().map(|r| r.ttft_ms.p95).fold(f64::MAX, f64::min);
    let best_tput = others
        .iter()
        .map(|r| r.throughput.steady_output_tok_s)
        .fold(0.0, f64::max);
    let mut notes = Vec::new();
    let wins = format!("best in {} of {} replicas", c.kvroute_p95_wins(), c.replicas.len());
    let p95_ok = kv.ttft_ms.p95 <= best_p95 * 1.0001;
    notes.push(if p95_ok {
        format!(
            "median TTFT p95 best of the non-oracle policies ({:.0} ms; {wins})",
            kv.ttft_ms.p95
        )
    } else {
        let who = others
            .iter()
            .filter(|r| r.ttft_ms.p95 < kv.ttft_ms.p95)
            .map(|r| r.policy.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "**missed**: median TTFT p95 {:.0} ms vs {:.0} ms (beaten by {who}; {wins})",
            kv.ttft_ms.p95, best_p95
        )
    });
    // Steady-state throughput within 1% counts as equal: below capacity every policy that
    // keeps up serves the offered load.
    notes.push(if kv.throughput.steady_output_tok_s >= best_tput * 0.99 {
        "steady throughput at least as good (within 1%)".to_string()
    } else {
        format!(
            "**missed**: steady throughput {:.0} vs {:.0} tok/s",
            kv.throughput.steady_output_tok_s, best_tput
        )
    });
    if let Some(o) = runs.iter().find(|r| r.policy == "oracle") {
        let ok = kv.prefix_hit_rate >= o.prefix_hit_rate * 0.9;
        notes.push(format!(
            "{}hit rate {:.1}% vs oracle {:.1}%",
            if ok { "" } else { "**missed**: " },
            kv.prefix_hit_rate * 100.0,
            o.prefix_hit_rate * 100.0
        ));
    }
    if let Some(rr) = runs.iter().find(|r| r.policy == "round-robin") {
        notes.push(format!(
            "TTFT p95 {:.1}× lower than round-robin",
            rr.ttft_ms.p95 / kv.ttft_ms.p95.max(1e-9)
        ));
    }
    if let Some(kv) = c.steady.iter().find(|r| r.policy == "kvroute") {
        let best = c
            .steady
            .iter()
            .filter(|r| is_peer(r))
            .map(|r| r.ttft_ms.p95)
            .fold(f64::MAX, f64::min);
        notes.push(if kv.ttft_ms.p95 <= best * 1.0001 {
            format!("steady state: median TTFT p95 best ({:.0} ms)", kv.ttft_ms.p95)
        } else {
            format!(
                "**missed** in the steady state: median TTFT p95 {:.0} vs {:.0} ms",
                kv.ttft_ms.p95, best
            )
        });
    }
    format!("kvroute: {}.", notes.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Segment;

    fn requests(n: usize, gap_ms: f64) -> Vec<SimRequest> {
        (0..n)
            .map(|i| SimRequest {
                arrival_ms: i as f64 * gap_ms,
                segments: vec![Segment::new(i as u64, 100)],
                output_tokens: 10,
            })
            .collect()
    }

    #[test]
    fn replica_zero_is_the_workload_and_others_only_move_arrivals_a_little() {
        let base = requests(200, 100.0);
        assert_eq!(perturbed(&base, 0), base);
        let a = perturbed(&base, 1);
        let b = perturbed(&base, 2);
        assert_ne!(a, b, "replicas differ");
        assert!(a.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms), "sorted");
        let mut seeds: Vec<u64> = a.iter().map(|r| r.segments[0].seed).collect();
        seeds.sort_unstable();
        assert_eq!(seeds, (0..200).collect::<Vec<u64>>(), "same requests");
        for r in &a {
            let original = r.segments[0].seed as f64 * 100.0;
            assert!((r.arrival_ms - original).abs() <= 50.0 + 1e-9 || r.arrival_ms == 0.0);
        }
        assert_eq!(perturbed(&base, 1), a, "deterministic");
    }

    fn run_of(policy: &str, ttfts: &[(f64, f64)]) -> RunReport {
        let records: Vec<crate::report::Record> = ttfts
            .iter()
            .map(|(arrival_ms, ttft_ms)| crate::report::Record {
                arrival_ms: *arrival_ms,
                ttft_ms: *ttft_ms,
                finish_ms: arrival_ms + ttft_ms + 10.0,
                prompt_tokens: 100,
                output_tokens: 2,
                ..Default::default()
            })
            .collect();
        let mut r = RunReport::from_records(policy, records.len(), &records, &[], 1);
        r.records = records;
        r
    }

    #[test]
    fn the_steady_state_counts_only_the_later_arrivals_in_the_median_replica() {
        // Slow cold starts (before 1 s), then 10 ms for one policy and 20 ms for the other;
        // the middle replica of three sets each median.
        let replica = |steady_a: f64, steady_b: f64| {
            let a: Vec<(f64, f64)> = (0..20)
                .map(|i| (i as f64 * 100.0, if i < 10 { 500.0 } else { steady_a }))
                .collect();
            let b: Vec<(f64, f64)> = (0..20)
                .map(|i| (i as f64 * 100.0, if i < 10 { 900.0 } else { steady_b }))
                .collect();
            vec![run_of("a", &a), run_of("b", &b)]
        };
        let replicas = vec![replica(10.0, 20.0), replica(12.0, 25.0), replica(11.0, 30.0)];
        let steady = steady_medians(&replicas, 1000.0);
        assert_eq!(steady.len(), 2);
        assert_eq!(steady[0].policy, "a");
        assert!((steady[0].ttft_ms.p95 - 11.0).abs() < 1e-9, "{}", steady[0].ttft_ms.p95);
        assert!((steady[1].ttft_ms.p95 - 25.0).abs() < 1e-9, "{}", steady[1].ttft_ms.p95);
        // The whole runs' p95 is the cold start's.
        assert!(replicas[0][0].ttft_ms.p95 >= 500.0);
    }

    #[test]
    fn the_json_lists_each_request_only_when_asked() {
        let run = |p| run_of(p, &[(0.0, 5.0), (10.0, 7.0), (20.0, 9.0)]);
        let cell = Cell {
            workload: "w".into(),
            load_pct: 50,
            arrival_rate: 1.0,
            topology: "one router".into(),
            replicas: vec![vec![run("a"), run("b")], vec![run("a"), run("b")]],
            steady_after_ms: None,
            steady: Vec::new(),
        };
        let cells = [cell];
        let plain = json(&cells, false).unwrap();
        assert!(plain[0]["replicas"][1][1].get("records").is_none());
        assert_eq!(plain[0]["replicas"][1][1]["policy"], "b");
        let full = json(&cells, true).unwrap();
        let records = full[0]["replicas"][1][1]["records"].as_array().unwrap();
        assert_eq!(records.len(), 3);
        assert_eq!(records[1]["arrival_ms"], 10.0);
        assert_eq!(records[1]["ttft_ms"], 7.0);
        // Everything else is as without them.
        let mut stripped = full.clone();
        for replica in stripped[0]["replicas"].as_array_mut().unwrap() {
            for run in replica.as_array_mut().unwrap() {
                run.as_object_mut().unwrap().remove("records");
            }
        }
        assert_eq!(stripped, plain);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(Vec::new()), 0.0);
    }
}
