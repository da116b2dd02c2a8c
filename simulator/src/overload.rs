//! Overload by class: what each priority band and each tenant got from a run — offered,
//! completed, answered 429, held, the wait and TTFT of those completed, and goodput
//! (requests completed within a TTFT objective, per second of arrivals: each request's own,
//! `Record::ttft_objective_ms`, else the run's). Starvation shows
//! as a class whose completions or goodput fall to nothing while others are served.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::report::{Percentiles, RunReport};

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClassStats {
    pub offered: usize,
    pub completed: usize,
    pub rejected: usize,
    /// Completed after waiting at the gateway.
    pub held: usize,
    pub wait_p99_ms: f64,
    pub ttft_ms: Percentiles,
    /// Completed with TTFT within the objective, per second of the arrival span.
    pub goodput: f64,
}

/// Which class a request is in: its band or its tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Class {
    Band(i64),
    Tenant(u32),
}

/// Every band's and every tenant's stats in `run`.
pub fn by_class(run: &RunReport, slo_ms: f64, span_s: f64) -> BTreeMap<Class, ClassStats> {
    let mut groups: BTreeMap<Class, (Vec<f64>, Vec<f64>, usize, usize)> = BTreeMap::new();
    for r in &run.records {
        for c in [Class::Band(r.priority), Class::Tenant(r.tenant)] {
            let g = groups.entry(c).or_default();
            g.0.push(r.ttft_ms);
            if r.held_ms > 0.0 {
                g.1.push(r.held_ms);
            }
        }
    }
    for r in &run.rejections {
        for c in [Class::Band(r.priority), Class::Tenant(r.tenant)] {
            groups.entry(c).or_default().2 += 1;
        }
    }
    for g in groups.values_mut() {
        g.3 = 0;
    }
    for r in run.records.iter().filter(|r| in_time(r, slo_ms)) {
        for c in [Class::Band(r.priority), Class::Tenant(r.tenant)] {
            if let Some(g) = groups.get_mut(&c) {
                g.3 += 1;
            }
        }
    }
    groups
        .into_iter()
        .map(|(c, (mut ttft, mut waits, rejected, good))| {
            let completed = ttft.len();
            let held = waits.len();
            let stats = ClassStats {
                offered: completed + rejected,
                completed,
                rejected,
                held,
                wait_p99_ms: Percentiles::of(&mut waits).p99,
                ttft_ms: Percentiles::of(&mut ttft),
                goodput: good as f64 / span_s.max(1e-9),
            };
            (c, stats)
        })
        .collect()
}

/// Each class's stats as medians over `replicas` (runs of one policy), each figure on its
/// own; a class missing from a replica counts as nothing offered there.
pub fn median_by_class(replicas: &[RunReport], slo_ms: f64, span_s: f64) -> BTreeMap<Class, ClassStats> {
    let each: Vec<BTreeMap<Class, ClassStats>> = replicas.iter().map(|r| by_class(r, slo_ms, span_s)).collect();
    let classes: std::collections::BTreeSet<Class> = each.iter().flat_map(|m| m.keys().copied()).collect();
    classes
        .into_iter()
        .map(|c| {
            let stats: Vec<ClassStats> = each.iter().map(|m| m.get(&c).cloned().unwrap_or_default()).collect();
            let med = |f: &dyn Fn(&ClassStats) -> f64| median(stats.iter().map(f).collect());
            let count = |f: &dyn Fn(&ClassStats) -> usize| med(&|s| f(s) as f64).round() as usize;
            let s = ClassStats {
                offered: count(&|s| s.offered),
                completed: count(&|s| s.completed),
                rejected: count(&|s| s.rejected),
                held: count(&|s| s.held),
                wait_p99_ms: med(&|s| s.wait_p99_ms),
                ttft_ms: Percentiles::median_of(&stats, |s| &s.ttft_ms),
                goodput: med(&|s| s.goodput),
            };
            (c, s)
        })
        .collect()
}

pub use crate::report::median;

/// The side-by-side table of `median_by_class` for every policy's replicas (requests that
/// never completed nor were answered 429 — still running when a run was cut short — are not
/// counted).
pub fn table(policies: &[Vec<RunReport>], slo_ms: f64, span_s: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| policy | class | offered | completed | 429 | held | wait p99 (ms) | TTFT p50 | TTFT p99 | goodput (req/s, TTFT within its objective, else ≤ {slo_ms} ms) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    for replicas in policies {
        let Some(run) = replicas.first() else { continue };
        for (c, s) in median_by_class(replicas, slo_ms, span_s) {
            let class = match c {
                Class::Band(p) => format!("priority {p}"),
                Class::Tenant(t) => format!("tenant {t}"),
            };
            let _ = writeln!(
                out,
                "| {} | {class} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.2} |",
                run.policy,
                s.offered,
                s.completed,
                s.rejected,
                s.held,
                s.wait_p99_ms,
                s.ttft_ms.p50,
                s.ttft_ms.p99,
                s.goodput
            );
        }
    }
    out
}

/// Completed within its objective (`slo_ms` for a request without one), per second of
/// `span_s`, over every class.
pub fn goodput(run: &RunReport, slo_ms: f64, span_s: f64) -> f64 {
    run.records.iter().filter(|r| in_time(r, slo_ms)).count() as f64 / span_s.max(1e-9)
}

/// Whether `r`'s first token came within its own objective, or `slo_ms` without one.
fn in_time(r: &crate::report::Record, slo_ms: f64) -> bool {
    r.ttft_ms <= r.ttft_objective_ms.unwrap_or(slo_ms)
}

/// The per-class table (tenants, priority bands, 429s) and each policy's goodput, as text:
/// medians over each policy's replicas (`replicas[i]`: policy i's runs), goodput and 429s
/// with their range; and the same as JSON, one entry per policy.
pub fn summary(replicas: &[Vec<RunReport>], ttft_slo_ms: f64, span_s: f64) -> (String, serde_json::Value) {
    let mut out = String::new();
    let mut json = Vec::new();
    let n = replicas.first().map_or(1, Vec::len);
    let of = if n > 1 {
        format!(", medians of {n} replicas")
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "by class (requests per second of the {span_s:.0} s of arrivals reported{of}):"
    );
    out.push_str(&table(replicas, ttft_slo_ms, span_s));
    let own = replicas
        .iter()
        .flatten()
        .any(|r| r.records.iter().any(|x| x.ttft_objective_ms.is_some()));
    let within = if own {
        format!("TTFT within its band's objective, else ≤ {ttft_slo_ms} ms")
    } else {
        format!("TTFT ≤ {ttft_slo_ms} ms")
    };
    for rs in replicas {
        let Some(first) = rs.first() else { continue };
        let good: Vec<f64> = rs.iter().map(|r| goodput(r, ttft_slo_ms, span_s)).collect();
        let refused: Vec<f64> = rs.iter().map(|r| r.rejections.len() as f64).collect();
        let range = |v: &[f64], digits: usize| match v.len() {
            1 => String::new(),
            _ => format!(
                " ({:.digits$}–{:.digits$})",
                v.iter().copied().fold(f64::INFINITY, f64::min),
                v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            ),
        };
        let _ = writeln!(
            out,
            "{}: goodput {:.2}{} req/s ({within}), 429: {:.0}{}",
            first.policy,
            median(good.clone()),
            range(&good, 2),
            median(refused.clone()),
            range(&refused, 0)
        );
        let spread = |v: &[f64]| {
            serde_json::json!({
                "median": median(v.to_vec()),
                "min": v.iter().copied().fold(f64::INFINITY, f64::min),
                "max": v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            })
        };
        let by_class: Vec<serde_json::Value> = median_by_class(rs, ttft_slo_ms, span_s)
            .into_iter()
            .map(|(c, s)| {
                let (kind, id) = match c {
                    Class::Band(p) => ("priority", p),
                    Class::Tenant(t) => ("tenant", i64::from(t)),
                };
                serde_json::json!({ "class": kind, "id": id, "stats": s })
            })
            .collect();
        json.push(serde_json::json!({
            "policy": first.policy,
            "span_s": span_s,
            "goodput_req_s": spread(&good),
            "rejected": spread(&refused),
            "by_class": by_class,
        }));
    }
    (out, serde_json::Value::Array(json))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Record, Rejection};

    #[test]
    fn classes_count_completions_rejections_and_goodput_apart() {
        let rec = |priority, tenant, ttft_ms, held_ms| Record {
            ttft_ms,
            held_ms,
            priority,
            tenant,
            ..Record::default()
        };
        let mut run = RunReport::from_records(
            "kvroute",
            4,
            &[rec(1, 0, 100.0, 0.0), rec(0, 0, 900.0, 400.0), rec(0, 1, 3000.0, 0.0)],
            &[],
            1,
        );
        run.rejections = vec![Rejection {
            priority: 0,
            tenant: 1,
            ..Rejection::default()
        }];
        let c = by_class(&run, 1000.0, 2.0);
        let low = &c[&Class::Band(0)];
        assert_eq!((low.offered, low.completed, low.rejected, low.held), (3, 2, 1, 1));
        assert_eq!(low.goodput, 0.5, "one of its completions met 1 s, over 2 s");
        assert_eq!(c[&Class::Tenant(1)].goodput, 0.0);
        assert_eq!(goodput(&run, 1000.0, 2.0), 1.0);
        // With its own objective of 5 s, the 3 s completion is in time too.
        run.records[2].ttft_objective_ms = Some(5000.0);
        assert_eq!(goodput(&run, 1000.0, 2.0), 1.5);
        assert_eq!(by_class(&run, 1000.0, 2.0)[&Class::Tenant(1)].goodput, 0.5);
        run.records[0].ttft_objective_ms = Some(50.0);
        assert_eq!(
            by_class(&run, 1000.0, 2.0)[&Class::Band(1)].goodput,
            0.0,
            "100 ms misses its own 50 ms"
        );
        assert!(table(&[vec![run.clone()]], 1000.0, 2.0).contains("| kvroute | tenant 1 | 2 | 1 | 1 |"));
        // Over replicas, each figure is the median; a class a replica lacks counts as 0.
        run.records[0].ttft_objective_ms = None;
        let mut other = run.clone();
        other.records.truncate(1);
        other.rejections.clear();
        let third = RunReport::from_records("kvroute", 4, &[], &[], 1);
        let m = median_by_class(&[run.clone(), other, third], 1000.0, 2.0);
        assert_eq!(m[&Class::Band(1)].completed, 1);
        assert_eq!(m[&Class::Band(0)].offered, 0, "offered 3, 0 and 0: median 0");
        assert_eq!(m[&Class::Band(1)].goodput, 0.5);
        assert_eq!(median(vec![3.0, 1.0, 2.0, 10.0]), 2.5);
    }
}
