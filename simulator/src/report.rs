//! Per-run outcomes: latency percentiles, throughput, prefix hit rate, per-server load, as a
//! side-by-side table, JSON (`{"runs": [...]}`) and an SVG plot (TTFT CDF per policy and
//! requests per server).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::engine::{Engine, Finished};

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Record {
    pub server: usize,
    pub arrival_ms: f64,
    pub finish_ms: f64,
    pub ttft_ms: f64,
    pub itl_ms: f64,
    pub e2e_ms: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// The longest prefix of its prompt any server had cached when it arrived (replay
    /// only; 0 in live runs): the reuse a router could reach.
    pub reachable_tokens: u64,
    /// Replay: how long the gateway held it before routing it (`overload.hold`); its
    /// TTFT and end-to-end time include the wait.
    pub held_ms: f64,
    /// Replay with `--classes`: its priority band and tenant.
    pub priority: i64,
    pub tenant: u32,
    /// Replay with `--objectives`: the TTFT objective it sent (its band's); goodput counts
    /// it within this instead of `--ttft-slo-ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_objective_ms: Option<f64>,
}

/// Replay: a request the gateway answered 429 (shed at once, or held and then refused).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rejection {
    pub arrival_ms: f64,
    pub waited_ms: f64,
    pub priority: i64,
    pub tenant: u32,
}

impl Record {
    pub fn from_finished(f: &Finished, server: usize) -> Record {
        Record {
            server,
            arrival_ms: f.arrival,
            finish_ms: f.finish,
            ttft_ms: f.first_token - f.arrival,
            itl_ms: f.itl_mean,
            e2e_ms: f.finish - f.arrival,
            prompt_tokens: f.prompt_tokens,
            cached_tokens: f.cached_tokens,
            output_tokens: f.output_tokens,
            ..Record::default()
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub mean: f64,
}

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl Percentiles {
    /// Each percentile's median over `items` (`of` picks an item's percentiles).
    pub fn median_of<T>(items: &[T], of: impl Fn(&T) -> &Percentiles) -> Percentiles {
        let med = |f: &dyn Fn(&Percentiles) -> f64| median(items.iter().map(|i| f(of(i))).collect());
        Percentiles {
            p50: med(&|p| p.p50),
            p95: med(&|p| p.p95),
            p99: med(&|p| p.p99),
            mean: med(&|p| p.mean),
        }
    }

    pub fn of(values: &mut [f64]) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let at = |p: f64| values[((values.len() as f64 - 1.0) * p).round() as usize];
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        Percentiles {
            p50: round3(at(0.5)),
            p95: round3(at(0.95)),
            p99: round3(at(0.99)),
            mean: round3(mean),
        }
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Throughput {
    pub input_tok_s: f64,
    pub output_tok_s: f64,
    pub req_s: f64,
    /// Output tokens per second while requests still arrive (from 10% into the arrival span
    /// to the last arrival; each request's tokens spread evenly from its first token to its
    /// end): the rate the fleet sustains, without the drain of the last requests that
    /// `output_tok_s` includes. Equal to `output_tok_s` when all requests arrive at once.
    #[serde(default)]
    pub steady_output_tok_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ServerStats {
    pub requests: u64,
    pub share: f64,
    pub hit_rate: f64,
    pub mean_kv_usage: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RunReport {
    pub policy: String,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub throughput: Throughput,
    pub prefix_hit_rate: f64,
    /// Replay: the hit rate a router could reach (the longest cached prefix on any server
    /// at each arrival, over all prompt tokens), and the share of that reuse this policy
    /// captured (cached / reachable; above 1 when requests share a prefix that was still
    /// being computed when they arrived).
    pub reachable_hit_rate: f64,
    pub captured_reuse: f64,
    pub evictions: u64,
    pub preemptions: u64,
    pub per_server: Vec<ServerStats>,
    pub sim_wall_s: f64,
    /// TTFT at quantiles 0, 0.01, …, 1 (ms): enough to plot the CDF from the JSON.
    pub ttft_cdf_ms: Vec<f64>,
    /// Each completed request (in the JSON only from `matrix --records`).
    #[serde(skip)]
    pub records: Vec<Record>,
    /// Requests the gateway answered 429 (replay with `overload.hold`; not in the JSON).
    #[serde(skip)]
    pub rejections: Vec<Rejection>,
    /// Replay: the fleet's evictions so far at each scrape tick, `(ms, count)`, so a phase
    /// of the run can report its own (not in the JSON).
    #[serde(skip)]
    pub eviction_marks: Vec<(f64, u64)>,
    /// Live bench: why the failed requests failed, cause → count (the first run's in a
    /// median; absent from the JSON when none failed).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub failures: BTreeMap<String, usize>,
}

impl RunReport {
    /// Server `server`'s share of the requests that arrived in `[from_ms, to_ms)`.
    pub fn share_between(&self, server: usize, from_ms: f64, to_ms: f64) -> f64 {
        let window: Vec<&Record> = self
            .records
            .iter()
            .filter(|r| (from_ms..to_ms).contains(&r.arrival_ms))
            .collect();
        let mine = window.iter().filter(|r| r.server == server).count();
        mine as f64 / window.len().max(1) as f64
    }

    /// The first run with every figure replaced by its median over `runs`: latency
    /// percentiles, throughput, hit rates, evictions, preemptions, request counts, the TTFT
    /// CDF point by point and each server's figures server by server (so the table's "max
    /// share" is the largest of the servers' median shares). The records, refusals and
    /// eviction marks stay the first run's: what is computed from them (goodput, classes,
    /// costs, phases) is computed per run and then taken the median of.
    pub fn median_of(runs: &[RunReport]) -> RunReport {
        let Some(first) = runs.first() else {
            return RunReport::default();
        };
        let med = |f: &dyn Fn(&RunReport) -> f64| median(runs.iter().map(f).collect());
        let pct = |f: &dyn Fn(&RunReport) -> &Percentiles| Percentiles::median_of(runs, f);
        RunReport {
            ttft_ms: pct(&|r| &r.ttft_ms),
            itl_ms: pct(&|r| &r.itl_ms),
            e2e_ms: pct(&|r| &r.e2e_ms),
            throughput: Throughput {
                input_tok_s: med(&|r| r.throughput.input_tok_s),
                output_tok_s: med(&|r| r.throughput.output_tok_s),
                req_s: med(&|r| r.throughput.req_s),
                steady_output_tok_s: med(&|r| r.throughput.steady_output_tok_s),
            },
            prefix_hit_rate: med(&|r| r.prefix_hit_rate),
            reachable_hit_rate: med(&|r| r.reachable_hit_rate),
            captured_reuse: med(&|r| r.captured_reuse),
            evictions: med(&|r| r.evictions as f64).round() as u64,
            preemptions: med(&|r| r.preemptions as f64).round() as u64,
            requests: med(&|r| r.requests as f64).round() as usize,
            completed: med(&|r| r.completed as f64).round() as usize,
            failed: med(&|r| r.failed as f64).round() as usize,
            sim_wall_s: med(&|r| r.sim_wall_s),
            per_server: match runs.iter().all(|r| r.per_server.len() == first.per_server.len()) {
                true => (0..first.per_server.len())
                    .map(|k| ServerStats {
                        requests: med(&|r| r.per_server[k].requests as f64).round() as u64,
                        share: med(&|r| r.per_server[k].share),
                        hit_rate: med(&|r| r.per_server[k].hit_rate),
                        mean_kv_usage: med(&|r| r.per_server[k].mean_kv_usage),
                    })
                    .collect(),
                false => first.per_server.clone(),
            },
            ttft_cdf_ms: match runs.iter().all(|r| r.ttft_cdf_ms.len() == first.ttft_cdf_ms.len()) {
                true => (0..first.ttft_cdf_ms.len())
                    .map(|k| med(&|r| r.ttft_cdf_ms[k]))
                    .collect(),
                false => first.ttft_cdf_ms.clone(),
            },
            ..first.clone()
        }
    }

    /// The requests that arrived in `[from_ms, to_ms)` as a run of their own; evictions are
    /// those between the scrape ticks nearest the bounds (0 without marks), preemptions and
    /// KV usage are not split (0). The requests refused in that window count as offered
    /// there (a failed one without a record is not seen).
    pub fn phase(&self, from_ms: f64, to_ms: f64) -> RunReport {
        let within = |at: f64| (from_ms..to_ms).contains(&at);
        let done: Vec<Record> = self.records.iter().filter(|r| within(r.arrival_ms)).cloned().collect();
        let refused: Vec<Rejection> = self
            .rejections
            .iter()
            .filter(|r| within(r.arrival_ms))
            .cloned()
            .collect();
        let mut p = Self::from_records(
            &self.policy,
            done.len() + refused.len(),
            &done,
            &[],
            self.per_server.len(),
        );
        p.rejections = refused;
        let at = |t: f64| {
            self.eviction_marks
                .iter()
                .take_while(|(ms, _)| *ms <= t)
                .last()
                .map_or(0, |(_, n)| *n)
        };
        p.evictions = at(to_ms).saturating_sub(at(from_ms));
        p
    }

    /// `engines` may be empty (live runs): then evictions, preemptions and KV usage are 0.
    pub fn build(policy: &str, requests: usize, records: Vec<Option<Record>>, engines: &[Engine]) -> RunReport {
        let done: Vec<Record> = records.into_iter().flatten().collect();
        Self::from_records(policy, requests, &done, engines, engines.len())
    }

    pub fn from_records(
        policy: &str,
        requests: usize,
        done: &[Record],
        engines: &[Engine],
        servers: usize,
    ) -> RunReport {
        let mut ttft: Vec<f64> = done.iter().map(|r| r.ttft_ms).collect();
        let mut itl: Vec<f64> = done.iter().filter(|r| r.output_tokens > 1).map(|r| r.itl_ms).collect();
        let mut e2e: Vec<f64> = done.iter().map(|r| r.e2e_ms).collect();
        let start = done.iter().map(|r| r.arrival_ms).fold(f64::MAX, f64::min);
        let end = done.iter().map(|r| r.finish_ms).fold(0.0, f64::max);
        let span_s = ((end - start) / 1000.0).max(1e-9);
        let prompt: u64 = done.iter().map(|r| r.prompt_tokens).sum();
        let cached: u64 = done.iter().map(|r| r.cached_tokens).sum();
        let reachable: u64 = done.iter().map(|r| r.reachable_tokens).sum();
        let output_tok_s = done.iter().map(|r| r.output_tokens).sum::<u64>() as f64 / span_s;
        let per_server = (0..servers)
            .map(|s| {
                let mine: Vec<&Record> = done.iter().filter(|r| r.server == s).collect();
                let p: u64 = mine.iter().map(|r| r.prompt_tokens).sum();
                let c: u64 = mine.iter().map(|r| r.cached_tokens).sum();
                ServerStats {
                    requests: mine.len() as u64,
                    share: round3(mine.len() as f64 / done.len().max(1) as f64),
                    hit_rate: round3(if p == 0 { 0.0 } else { c as f64 / p as f64 }),
                    mean_kv_usage: round3(engines.get(s).map_or(0.0, Engine::mean_kv_usage)),
                }
            })
            .collect();
        let ttft_p = Percentiles::of(&mut ttft);
        let ttft_cdf_ms = if ttft.is_empty() {
            Vec::new()
        } else {
            (0..=100).map(|q| round3(ttft[((ttft.len() - 1) * q) / 100])).collect()
        };
        RunReport {
            policy: policy.to_string(),
            requests,
            completed: done.len(),
            failed: requests - done.len(),
            ttft_ms: ttft_p,
            itl_ms: Percentiles::of(&mut itl),
            e2e_ms: Percentiles::of(&mut e2e),
            throughput: Throughput {
                input_tok_s: round3(prompt as f64 / span_s),
                output_tok_s: round3(output_tok_s),
                req_s: round3(done.len() as f64 / span_s),
                steady_output_tok_s: round3(steady_output_tok_s(done).unwrap_or(output_tok_s)),
            },
            prefix_hit_rate: round3(if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            }),
            reachable_hit_rate: round3(if prompt == 0 {
                0.0
            } else {
                reachable as f64 / prompt as f64
            }),
            captured_reuse: round3(if reachable == 0 {
                0.0
            } else {
                cached as f64 / reachable as f64
            }),
            evictions: engines.iter().map(|e| e.kv().evictions).sum(),
            preemptions: engines.iter().map(|e| e.counters.preemptions).sum(),
            per_server,
            sim_wall_s: 0.0,
            ttft_cdf_ms,
            records: done.to_vec(),
            rejections: Vec::new(),
            eviction_marks: Vec::new(),
            failures: BTreeMap::new(),
        }
    }
}

/// Output tokens per second inside the steady window (see `Throughput`), or `None` when the
/// arrivals span no time.
fn steady_output_tok_s(done: &[Record]) -> Option<f64> {
    let first = done.iter().map(|r| r.arrival_ms).fold(f64::MAX, f64::min);
    let last = done.iter().map(|r| r.arrival_ms).fold(0.0, f64::max);
    let (t0, t1) = (first + 0.1 * (last - first), last);
    if done.is_empty() || t1 - t0 < 1.0 {
        return None;
    }
    let tokens: f64 = done
        .iter()
        .map(|r| {
            let start = r.arrival_ms + r.ttft_ms;
            let len = r.finish_ms - start;
            if len <= 1e-6 {
                // All of its tokens at one instant.
                return if (t0..=t1).contains(&start) {
                    r.output_tokens as f64
                } else {
                    0.0
                };
            }
            let overlap = (r.finish_ms.min(t1) - start.max(t0)).max(0.0);
            r.output_tokens as f64 * (overlap / len).min(1.0)
        })
        .sum();
    Some(tokens / ((t1 - t0) / 1000.0))
}

impl RunReport {
    /// Latencies × `k` and throughput ÷ `k`: converts a live run at `--time-scale k` to
    /// simulated (GPU) time.
    pub fn scale_time(&mut self, k: f64) {
        for p in [&mut self.ttft_ms, &mut self.itl_ms, &mut self.e2e_ms] {
            for v in [&mut p.p50, &mut p.p95, &mut p.p99, &mut p.mean] {
                *v = round3(*v * k);
            }
        }
        for v in &mut self.ttft_cdf_ms {
            *v = round3(*v * k);
        }
        let t = &mut self.throughput;
        for v in [&mut t.input_tok_s, &mut t.output_tok_s, &mut t.req_s] {
            *v = round3(*v / k);
        }
    }
}

pub mod cost;
mod render;
pub use render::{svg, table};
pub(crate) use render::{xml, COLORS};

#[cfg(test)]
mod steady_tests {
    use super::*;

    fn record(arrival_ms: f64, ttft_ms: f64, finish_ms: f64, output_tokens: u64) -> Record {
        Record {
            server: 0,
            arrival_ms,
            finish_ms,
            ttft_ms,
            itl_ms: 1.0,
            e2e_ms: finish_ms - arrival_ms,
            prompt_tokens: 10,
            cached_tokens: 0,
            output_tokens,
            ..Record::default()
        }
    }

    #[test]
    fn steady_throughput_is_the_rate_served_while_requests_arrive_without_the_drain() {
        // One request per second for 100 s, each 100 tokens over 1 s; then a long straggler.
        let mut done: Vec<Record> = (0..100)
            .map(|i| {
                let t = i as f64 * 1000.0;
                record(t, 10.0, t + 1010.0, 100)
            })
            .collect();
        done.push(record(99_000.0, 10.0, 400_000.0, 100));
        let r = RunReport::from_records("p", done.len(), &done, &[], 1);
        assert!(
            (r.throughput.steady_output_tok_s - 100.0).abs() < 2.0,
            "{}",
            r.throughput.steady_output_tok_s
        );
        assert!(r.throughput.output_tok_s < 30.0, "the drain dilutes the overall figure");
    }

    #[test]
    fn the_median_run_takes_each_figure_from_the_middle_run() {
        let runs: Vec<RunReport> = [(30.0, 7), (10.0, 9), (20.0, 8)]
            .iter()
            .map(|(p95, evictions)| RunReport {
                policy: "p".into(),
                ttft_ms: Percentiles {
                    p95: *p95,
                    ..Percentiles::default()
                },
                evictions: *evictions,
                ..RunReport::default()
            })
            .collect();
        let m = RunReport::median_of(&runs);
        assert_eq!((m.ttft_ms.p95, m.evictions, m.policy.as_str()), (20.0, 8, "p"));
        assert_eq!(RunReport::median_of(&runs[..1]), runs[0]);
    }

    #[test]
    fn the_median_run_takes_counts_shares_and_the_cdf_from_every_run() {
        let run = |completed, shares: [f64; 2], cdf: [f64; 2]| RunReport {
            completed,
            per_server: shares
                .iter()
                .map(|s| ServerStats {
                    share: *s,
                    ..ServerStats::default()
                })
                .collect(),
            ttft_cdf_ms: cdf.to_vec(),
            ..RunReport::default()
        };
        let runs = [
            run(90, [0.9, 0.1], [1.0, 50.0]),
            run(100, [0.5, 0.5], [2.0, 10.0]),
            run(95, [0.6, 0.4], [3.0, 30.0]),
        ];
        let m = RunReport::median_of(&runs);
        assert_eq!(m.completed, 95, "not the first run's 90");
        let shares: Vec<f64> = m.per_server.iter().map(|s| s.share).collect();
        assert_eq!(shares, vec![0.6, 0.4], "each server's median share");
        assert_eq!(m.ttft_cdf_ms, vec![2.0, 30.0]);
    }

    #[test]
    fn a_burst_falls_back_to_the_overall_rate() {
        let done = vec![record(0.0, 10.0, 1010.0, 100), record(0.0, 20.0, 2020.0, 100)];
        let r = RunReport::from_records("p", 2, &done, &[], 1);
        assert_eq!(r.throughput.steady_output_tok_s, r.throughput.output_tok_s);
    }
}

#[cfg(test)]
mod phase_tests {
    use super::*;

    #[test]
    fn a_phase_counts_the_requests_refused_in_its_window_as_offered() {
        let done = |arrival_ms: f64| Record {
            arrival_ms,
            finish_ms: arrival_ms + 100.0,
            ttft_ms: 50.0,
            e2e_ms: 100.0,
            ..Record::default()
        };
        let records = [done(1_000.0), done(5_000.0), done(6_000.0)];
        let mut run = RunReport::from_records("kvroute", 5, &records, &[], 1);
        let refused = |arrival_ms| Rejection {
            arrival_ms,
            ..Rejection::default()
        };
        run.rejections = vec![refused(2_000.0), refused(7_000.0)];
        let steady = run.phase(4_000.0, f64::MAX);
        assert_eq!((steady.requests, steady.completed, steady.failed), (3, 2, 1));
        assert_eq!(steady.rejections, vec![refused(7_000.0)]);
        let cold = run.phase(f64::MIN, 4_000.0);
        assert_eq!((cold.requests, cold.completed, cold.failed), (2, 1, 1));
    }
}
