//! Overload by class: what each priority band and each tenant got from a run — offered,
//! completed, answered 429, held, the wait and TTFT of those completed, and goodput
//! (requests completed within a TTFT objective, per second of arrivals). Starvation shows
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
        g.3 = g.0.iter().filter(|t| **t <= slo_ms).count();
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

/// The side-by-side table of `by_class` for every run (requests that never completed
/// nor were answered 429 — still running when a run was cut short — are not counted).
pub fn table(runs: &[RunReport], slo_ms: f64, span_s: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| policy | class | offered | completed | 429 | held | wait p99 (ms) | TTFT p50 | TTFT p99 | goodput (req/s, TTFT ≤ {slo_ms} ms) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    for run in runs {
        for (c, s) in by_class(run, slo_ms, span_s) {
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

/// Completed within `slo_ms`, per second of `span_s`, over every class.
pub fn goodput(run: &RunReport, slo_ms: f64, span_s: f64) -> f64 {
    run.records.iter().filter(|r| r.ttft_ms <= slo_ms).count() as f64 / span_s.max(1e-9)
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
        assert!(table(&[run], 1000.0, 2.0).contains("| kvroute | tenant 1 | 2 | 1 | 1 |"));
    }
}
